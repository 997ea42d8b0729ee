"""Proto chat messages and tools to the dicts that Hugging Face chat templates expect.

The shapes follow transformers' chat-template conventions (the ones model
authors write their templates against):

- ``{"role", "content": str}``; text parts are joined with newlines. The
  OpenAI ``developer`` role becomes ``system``: it is the same instruction slot
  under a newer name, and model templates only know ``system``.
- image parts: for a model with a vision encoder, its placeholder markup
  (``VisionInfo.placeholder_text``) at the part's place among the text parts, so
  templates keep getting content as a string; other models refuse them.
- assistant tool calls: ``{"id", "type": "function", "function": {"name",
  "arguments": dict}}``. Arguments are a parsed JSON *object*, not a string,
  because templates render them with ``tojson`` (a string would be quoted twice).
- tool results: ``{"role": "tool", "tool_call_id", "content"}``.
- ``reasoning_content`` is passed through for templates that replay it.
- tools: ``{"type": "function", "function": {"name", "description",
  "parameters": dict}}``.

Every failure names the offending field (``messages[2].tool_calls[0].arguments_json``)
as an ``InvalidArgument``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

from cachet.common.v1 import common_pb2
from cachet.errors import InvalidArgument

ROLES = ("system", "developer", "user", "assistant", "tool")
_TOOL_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")


def _invalid(field: str, problem: str) -> InvalidArgument:
    return InvalidArgument(f"{field}: {problem}", param=field)


def _parse_json_object(text: str, field: str, *, empty: dict[str, Any]) -> dict[str, Any]:
    if not text.strip():
        return dict(empty)
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise _invalid(field, f"not valid JSON ({error.msg} at position {error.pos})") from None
    if not isinstance(value, dict):
        raise _invalid(field, f"must be a JSON object, got {type(value).__name__}")
    return value


def _content(message: common_pb2.ChatMessage, field: str, image_text: str | None) -> str:
    texts = []
    for index, part in enumerate(message.content):
        kind = part.WhichOneof("part")
        if kind == "image_url":
            if image_text is None:
                raise _invalid(
                    f"{field}.content[{index}].image_url", "image input needs a model with a vision encoder"
                )
            texts.append(image_text)
        if kind == "text":
            texts.append(part.text)
    return "\n".join(texts)


def image_parts(messages: Sequence[common_pb2.ChatMessage]) -> list[tuple[str, str]]:
    """``(field, url)`` of every image part, in the order the prompt holds them."""
    return [
        (f"messages[{index}].content[{number}].image_url", part.image_url)
        for index, message in enumerate(messages)
        for number, part in enumerate(message.content)
        if part.WhichOneof("part") == "image_url"
    ]


def _tool_call(call: common_pb2.ToolCall, field: str) -> dict[str, Any]:
    if not _TOOL_NAME.fullmatch(call.name):
        raise _invalid(f"{field}.name", f"{call.name!r} is not a function name ([a-zA-Z0-9_-]{{1,64}})")
    arguments = _parse_json_object(call.arguments_json, f"{field}.arguments_json", empty={})
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": arguments}}


def message_to_dict(
    message: common_pb2.ChatMessage, index: int, image_text: str | None = None
) -> dict[str, Any]:
    """One proto message as a template dict; ``index`` is only used to name fields in errors;
    ``image_text``: what an image part renders to (None: image parts are refused)."""
    field = f"messages[{index}]"
    if message.role not in ROLES:
        raise _invalid(f"{field}.role", f"unknown role {message.role!r}; expected one of {', '.join(ROLES)}")
    if message.tool_calls and message.role != "assistant":
        raise _invalid(f"{field}.tool_calls", f"only assistant messages carry tool calls, not {message.role}")
    if message.role == "tool" and not message.tool_call_id:
        raise _invalid(f"{field}.tool_call_id", "a tool message must name the call it answers")
    converted: dict[str, Any] = {
        "role": "system" if message.role == "developer" else message.role,
        # Always a string, never absent: many templates concatenate it unguarded.
        "content": _content(message, field, image_text),
    }
    if message.name:
        converted["name"] = message.name
    if message.tool_calls:
        converted["tool_calls"] = [
            _tool_call(call, f"{field}.tool_calls[{number}]")
            for number, call in enumerate(message.tool_calls)
        ]
    if message.role == "tool":
        converted["tool_call_id"] = message.tool_call_id
    if message.reasoning_content:
        converted["reasoning_content"] = message.reasoning_content
    return converted


def messages_to_dicts(
    messages: Sequence[common_pb2.ChatMessage], image_text: str | None = None
) -> list[dict[str, Any]]:
    if not messages:
        raise _invalid("messages", "at least one message is required")
    return [message_to_dict(message, index, image_text) for index, message in enumerate(messages)]


def tool_to_dict(tool: common_pb2.Tool, index: int) -> dict[str, Any]:
    field = f"tools[{index}]"
    if not _TOOL_NAME.fullmatch(tool.name):
        raise _invalid(f"{field}.name", f"{tool.name!r} is not a function name ([a-zA-Z0-9_-]{{1,64}})")
    parameters = _parse_json_object(
        tool.parameters_schema_json,
        f"{field}.parameters_schema_json",
        # OpenAI allows omitting parameters: a function that takes none.
        empty={"type": "object", "properties": {}},
    )
    function: dict[str, Any] = {"name": tool.name, "description": tool.description, "parameters": parameters}
    return {"type": "function", "function": function}


def tools_to_dicts(tools: Sequence[common_pb2.Tool]) -> list[dict[str, Any]]:
    converted = [tool_to_dict(tool, index) for index, tool in enumerate(tools)]
    names = [tool["function"]["name"] for tool in converted]
    for index, name in enumerate(names):
        if name in names[:index]:
            raise _invalid(f"tools[{index}].name", f"{name!r} is offered twice")
    return converted
