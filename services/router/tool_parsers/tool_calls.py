"""A tool call as OpenAI streams it: a header, then argument text.

The first delta of a call carries its index, id and function name with empty
arguments; the deltas after it carry argument text only, as the model writes it.
Joined, the fragments are the call's arguments string exactly (the router builds
a non-streamed answer by joining them), so streamed and whole answers agree.

``streamed_call`` announces a call once its name is known and its arguments have
opened as a JSON object; a call whose shape cannot be streamed (arguments written
as a JSON string, keys in the other order) is checked whole here and sent as a
header and one fragment.
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


def is_offered(name: object, tool_names: Collection[str]) -> bool:
    """A call must name an offered function (any, when no list is given)."""
    return isinstance(name, str) and bool(name) and (not tool_names or name in tool_names)


def header(index: int, call_id: str, name: str) -> router_pb2.ToolCallDelta:
    return router_pb2.ToolCallDelta(index=index, id=call_id, name=name, arguments_delta="")


def fragment(index: int, text: str) -> router_pb2.ToolCallDelta:
    return router_pb2.ToolCallDelta(index=index, arguments_delta=text)


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


def whole_call(
    index: int, call_id: str, name: object, arguments: Any, tool_names: Collection[str]
) -> list[router_pb2.ToolCallDelta] | None:
    """A call read whole, as its header and one fragment; None when it is not a call of an offered tool."""
    if not is_offered(name, tool_names):
        return None
    text = arguments_text(arguments)
    if text is None:
        return None
    assert isinstance(name, str)
    return [header(index, call_id, name), fragment(index, text)]
