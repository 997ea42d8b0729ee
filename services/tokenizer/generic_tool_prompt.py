"""Cachet's generic tool rendering, for chat templates that know nothing about tools.

A template "supports tools" when its source mentions the ``tools`` variable;
transformers would silently drop tools for any other template, and the model
would never learn they exist. For those templates the conversation is rewritten
before rendering, in the Hermes / Qwen convention that many open models were
trained on and that the router's tool-call parser reads:

1. The tools go into a system block, merged after the text of the first system
   message (or as a new first system message when there is none)::

       # Tools

       You may call one or more functions to assist with the user query.

       You are provided with function signatures within <tools></tools> XML tags:
       <tools>
       {"type": "function", "function": {"name": ..., "description": ..., "parameters": {...}}}
       </tools>

       For each function call, return a json object with function name and arguments within
       <tool_call></tool_call> XML tags:
       <tool_call>
       {"name": <function-name>, "arguments": <args-json-object>}
       </tool_call>

2. An assistant message's tool calls are appended to its text, one block each:
   ``<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>``.
3. Tool results become a ``user`` message whose text is each result wrapped in
   ``<tool_response>\\n...\\n</tool_response>``; consecutive results share one
   message, because templates without tool support often insist on
   alternating user / assistant turns and reject unknown roles.

The rewrite applies to the messages whenever the template lacks tool support
(a conversation may replay tool calls even when no tools are offered now); the
system block is added only when tools are offered.
"""

from __future__ import annotations

import json
import re
from typing import Any

_TOOLS_VARIABLE = re.compile(r"\btools\b")

TOOLS_HEADER = (
    "# Tools\n\n"
    "You may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n"
)
TOOLS_FOOTER = (
    "\n\nFor each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n"
    '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
)


def template_supports_tools(template_source: str) -> bool:
    return bool(_TOOLS_VARIABLE.search(template_source))


def tools_system_block(tools: list[dict[str, Any]]) -> str:
    lines = "\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools)
    return f"{TOOLS_HEADER}<tools>\n{lines}\n</tools>{TOOLS_FOOTER}"


def tool_call_text(call: dict[str, Any]) -> str:
    function = call["function"]
    payload = json.dumps({"name": function["name"], "arguments": function["arguments"]}, ensure_ascii=False)
    return f"<tool_call>\n{payload}\n</tool_call>"


def _with_tool_calls(message: dict[str, Any]) -> dict[str, Any]:
    calls = "\n".join(tool_call_text(call) for call in message["tool_calls"])
    rewritten = {key: value for key, value in message.items() if key != "tool_calls"}
    rewritten["content"] = f"{message['content']}\n{calls}" if message["content"] else calls
    return rewritten


def _tool_response(message: dict[str, Any]) -> str:
    return f"<tool_response>\n{message['content']}\n</tool_response>"


def rewrite_for_generic_tools(
    messages: list[dict[str, Any]], tools: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """The conversation as a tool-less template should see it (see the module docstring)."""
    rewritten: list[dict[str, Any]] = []
    previous_was_tool = False
    for message in messages:
        if message["role"] == "tool":
            if previous_was_tool:
                rewritten[-1]["content"] += "\n" + _tool_response(message)
            else:
                rewritten.append({"role": "user", "content": _tool_response(message)})
            previous_was_tool = True
            continue
        previous_was_tool = False
        rewritten.append(_with_tool_calls(message) if message.get("tool_calls") else dict(message))
    if tools:
        block = tools_system_block(tools)
        if rewritten and rewritten[0]["role"] == "system" and rewritten[0]["content"]:
            rewritten[0]["content"] = f"{rewritten[0]['content']}\n\n{block}"
        elif rewritten and rewritten[0]["role"] == "system":
            rewritten[0]["content"] = block
        else:
            rewritten.insert(0, {"role": "system", "content": block})
    return rewritten
