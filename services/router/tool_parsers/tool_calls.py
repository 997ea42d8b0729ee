"""A parsed tool call, checked against the offered tools, as stream deltas.

Parsers emit a call only once all of it has been read and checked (a known
function name, arguments that are a JSON object): a call that turns out
malformed is then shown as content, never half-announced as a call. So each
call goes out as one ``ToolCallDelta`` holding its index, id, name and the whole
arguments text, which is a valid OpenAI stream (fragments may be any size) and
concatenates to exactly the non-streamed call.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Collection
from typing import Any

from cachet.router.v1 import router_pb2

# OpenAI's ids are "call_" and 24 alphanumerics; clients only echo them back.
_ID_ALPHABET = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"


def new_call_id() -> str:
    return "call_" + "".join(secrets.choice(_ID_ALPHABET) for _ in range(24))


def arguments_text(arguments: Any) -> str | None:
    """The arguments as OpenAI's JSON text, or None unless they are a JSON object."""
    if isinstance(arguments, str):
        # Some models write the arguments as a JSON string holding the object.
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None
    if not isinstance(arguments, dict):
        return None
    return json.dumps(arguments, ensure_ascii=False)


def call_delta(
    index: int, call_id: str, name: str, arguments: Any, tool_names: Collection[str]
) -> router_pb2.ToolCallDelta | None:
    """The whole call as one delta, or None when it is not a call of an offered tool."""
    if not isinstance(name, str) or (tool_names and name not in tool_names):
        return None
    text = arguments_text(arguments)
    if text is None:
        return None
    return router_pb2.ToolCallDelta(index=index, id=call_id, name=name, arguments_delta=text)
