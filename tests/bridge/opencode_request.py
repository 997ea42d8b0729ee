"""A chat-completions request as OpenCode sends it to a custom OpenAI-compatible provider.

Read from opencode-ai 1.18.33 (npm; its linux-x64 build) and @ai-sdk/openai-compatible 2.0.92,
which OpenCode uses for a provider configured with ``"npm": "@ai-sdk/openai-compatible"``:

- OpenCode turns on ``includeUsage`` for that provider, so a streamed turn carries
  ``stream: true`` and ``stream_options: {"include_usage": true}``;
- ``max_tokens`` is its OUTPUT_TOKEN_MAX, 32,000, when the model's config names no output limit;
- it sends no ``temperature``, ``top_p``, ``tool_choice`` or ``seed`` for a model it does not know
  (the AI SDK drops the undefined fields);
- one system message: its prompt for a model that is not GPT, Claude or Gemini, which opens
  with the text in opencode_system_prompt.txt (OpenCode's own, MIT; the whole is about 8 KB, cut after its first examples
  here so that the request fits the tiny test model's 2,048-token window), then on the next line
  the model's name and an environment block;
- its tools are function tools, sorted by name, whose parameters are JSON schemas of objects
  with ``additionalProperties: false``;
- besides the bearer key, its headers name the session twice (``x-session-affinity``, which is
  Cachet's affinity header, and ``X-Session-Id``), and the user agent is OpenCode's followed by
  the AI SDK's suffixes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

OPENCODE_MAX_TOKENS = 32_000
SYSTEM_PROMPT = (Path(__file__).parent / "opencode_system_prompt.txt").read_text()
DRAFT_07 = "http://json-schema.org/draft-07/schema#"


def _tool(name: str, description: str, properties: dict[str, Any], required: list[str]) -> dict[str, Any]:
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {
                "$schema": DRAFT_07,
                "type": "object",
                "properties": properties,
                "required": required,
                "additionalProperties": False,
            },
        },
    }


def _string(description: str) -> dict[str, str]:
    return {"type": "string", "description": description}


# The parameters are OpenCode's; the descriptions are each tool's opening words (the real ones
# run to pages).
TOOLS = [
    _tool(
        "bash",
        "Executes a given bash command in a persistent shell session with optional timeout.",
        {
            "command": _string("The command to execute"),
            "timeout": {"type": "number", "description": "Optional timeout in milliseconds"},
            "workdir": _string(
                "The working directory to run the command in. Defaults to the current directory. "
                "Use this instead of 'cd' commands."
            ),
        },
        ["command"],
    ),
    _tool(
        "edit",
        "Performs exact string replacements in files.",
        {
            "filePath": _string("The absolute path to the file to modify"),
            "oldString": _string("The text to replace"),
            "newString": _string("The text to replace it with (must be different from oldString)"),
            "replaceAll": {
                "type": "boolean",
                "description": "Replace all occurrences of oldString (default false)",
            },
        },
        ["filePath", "oldString", "newString"],
    ),
    _tool(
        "glob",
        "Fast file pattern matching tool that works with any codebase size.",
        {
            "pattern": _string("The glob pattern to match files against"),
            "path": _string(
                "The directory to search in. If not specified, the current working directory will be used."
            ),
        },
        ["pattern"],
    ),
    _tool(
        "grep",
        "Fast content search tool that works with any codebase size.",
        {
            "pattern": _string("The regex pattern to search for in file contents"),
            "path": _string("The directory to search in. Defaults to the current working directory."),
            "include": _string('File pattern to include in the search (e.g. "*.js", "*.{ts,tsx}")'),
        },
        ["pattern"],
    ),
    _tool(
        "read",
        "Reads a file or directory from the local filesystem.",
        {
            "filePath": _string("The absolute path to the file or directory to read"),
            "offset": {"type": "number", "description": "The line number to start reading from (1-indexed)"},
            "limit": {
                "type": "number",
                "description": "The maximum number of lines to read (defaults to 2000)",
            },
        },
        ["filePath"],
    ),
]


def environment(model: str, nonce: str) -> str:
    """What OpenCode appends to its prompt; the nonce stands in for the project's path, so that no
    other test's requests share this prefix."""
    return (
        f"You are powered by the model named {model}. The exact model ID is cachet/{model}\n"
        "Here is some useful information about the environment you are running in:\n"
        "<env>\n"
        f"  Working directory: /home/dev/{nonce}\n"
        f"  Workspace root folder: /home/dev/{nonce}\n"
        "  Is directory a git repo: yes\n"
        "  Platform: linux\n"
        "  Today's date: Fri Nov 27 2026\n"
        "</env>"
    )


def headers(session_id: str, api_key: str = "dev") -> dict[str, str]:
    # The AI SDK appends its packages' and the runtime's names to OpenCode's user agent; the
    # versions after OpenCode's are examples (the build bundles several copies of the SDK).
    return {
        "authorization": f"Bearer {api_key}",
        "content-type": "application/json",
        "user-agent": "opencode/1.18.33 ai-sdk/openai-compatible/2.0.92 ai-sdk/provider-utils/4.0.8 runtime/bun/1.3.5",
        "x-session-affinity": session_id,
        "X-Session-Id": session_id,
        "accept": "*/*",
        "accept-encoding": "gzip, deflate, br, zstd",
    }


def body(model: str, nonce: str, question: str) -> dict[str, Any]:
    """One turn's body, keys in the order the AI SDK writes them."""
    return {
        "model": model,
        "max_tokens": OPENCODE_MAX_TOKENS,
        "messages": [
            {"role": "system", "content": f"{SYSTEM_PROMPT}\n{environment(model, nonce)}"},
            {"role": "user", "content": question},
        ],
        "tools": TOOLS,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
