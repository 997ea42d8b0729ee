"""Output of a request whose tool call is forced by grammar (``tool_choice`` named or required).

``tool_choice`` builds the constraints these read (see there):

- named function: the whole output is the arguments object. It streams as it is
  generated (the grammar guarantees it parses, so there is nothing to take back):
  the first fragment carries index, id and name, later ones argument text only.
- required: the output is a JSON array of ``{"name", "arguments"}`` objects,
  each emitted as one call once its object is complete.

Text that does not fit (an engine that did not constrain, or output cut short
before the first call) goes out as content rather than failing the request.
"""

from __future__ import annotations

import json
from collections.abc import Collection

from cachet.router.output_parser import OutputDelta
from cachet.router.tool_parsers.text_scan import NotAnObject, json_object_end
from cachet.router.tool_parsers.tool_calls import call_delta, new_call_id
from cachet.router.v1 import router_pb2


class NamedToolCallParser:
    """The output is the arguments of a call to ``name``."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._started = False  # the call's first fragment went out
        self._as_content = False  # the output is not an object: all of it is content
        self._pending = ""  # trailing whitespace, shown only if more text follows

    def feed(self, text: str) -> OutputDelta:
        if self._as_content:
            return OutputDelta(content=text)
        if not self._started:
            text = text.lstrip()
            if not text:
                return OutputDelta()
            if text[0] != "{":
                self._as_content = True
                return OutputDelta(content=text)
        stripped = text.rstrip()
        if not stripped:
            self._pending += text
            return OutputDelta()
        fragment = router_pb2.ToolCallDelta(index=0, arguments_delta=self._pending + stripped)
        self._pending = text[len(stripped) :]
        if not self._started:
            self._started = True
            fragment.id, fragment.name = new_call_id(), self._name
        return OutputDelta(tool_calls=[fragment])

    def finish(self) -> OutputDelta:
        return OutputDelta()


class RequiredToolCallsParser:
    """The output is a JSON array of calls, one object each."""

    def __init__(self, tool_names: Collection[str]) -> None:
        self._tool_names = frozenset(tool_names)
        self._buffer = ""
        self._raw = ""  # all output, shown whole when it held no call at all
        self._opened = False  # the array's "[" was read
        self._calls = 0
        self._as_content = False

    def feed(self, text: str) -> OutputDelta:
        if self._as_content:
            return OutputDelta(content=text)
        self._buffer += text
        self._raw += text
        out = OutputDelta()
        while self._next_call(out):
            pass
        return out

    def finish(self) -> OutputDelta:
        rest, self._buffer = self._buffer.strip(), ""
        if self._as_content or rest in ("", "]"):
            return OutputDelta()
        # Cut short (max_tokens): the unfinished call is content, and with no call
        # made at all, so is the whole output.
        return OutputDelta(content=rest if self._calls else self._raw)

    def _next_call(self, out: OutputDelta) -> bool:
        body = self._buffer.lstrip()
        if not self._opened:
            if not body:
                return False
            if body[0] != "[":
                return self._give_up(out)
            self._opened = True
            self._buffer = body[1:]
            return True
        body = body.removeprefix(",").lstrip() if self._calls else body
        if not body or body.startswith("]"):
            return False
        try:
            end = json_object_end(body)
        except NotAnObject:
            return self._give_up(out)
        if end is None:
            return False
        try:
            payload = json.loads(body[:end])
        except json.JSONDecodeError:
            return self._give_up(out)
        delta = call_delta(
            self._calls, new_call_id(), payload.get("name"), payload.get("arguments", {}), self._tool_names
        )
        if delta is None:
            return self._give_up(out)
        out.tool_calls.append(delta)
        self._calls += 1
        self._buffer = body[end:]
        return True

    def _give_up(self, out: OutputDelta) -> bool:
        out.content += self._buffer if self._calls else self._raw
        self._buffer = ""
        self._as_content = True
        return False
