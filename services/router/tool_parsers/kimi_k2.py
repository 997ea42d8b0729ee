"""Kimi K2 tool calls, in the special tokens its chat template writes::

    <|tool_calls_section_begin|>
    <|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>{json}<|tool_call_end|>
    ...
    <|tool_calls_section_end|>

The call id is the model's own ``functions.NAME:IDX``: the template writes it back
in the next turn (``## Return of <id>``), so it is kept as is rather than replaced
by an OpenAI-style id. Text before the section is content. The arguments' end is
found by tracking JSON strings, so marker text inside an argument value does not
end the call. A call that does not fit the format (bad id, unknown function,
arguments not a JSON object, missing end marker) ends parsing: it and all text
after it go out as content.

These markers are special tokens: the router must detokenize with special tokens
kept (``selection`` says so for this family).
"""

from __future__ import annotations

import json
import re
from collections.abc import Collection
from enum import Enum, auto

from cachet.router.output_parser import OutputDelta
from cachet.router.tool_parsers.content_gate import ContentGate
from cachet.router.tool_parsers.text_scan import NotAnObject, json_object_end, partial_marker_length
from cachet.router.tool_parsers.tool_calls import call_delta

SECTION_BEGIN = "<|tool_calls_section_begin|>"
SECTION_END = "<|tool_calls_section_end|>"
CALL_BEGIN = "<|tool_call_begin|>"
ARGUMENT_BEGIN = "<|tool_call_argument_begin|>"
CALL_END = "<|tool_call_end|>"

# functions.get_weather:0 (the "functions." prefix is optional in what K2 writes).
_CALL_ID = re.compile(r"(?:functions\.)?(?P<name>[a-zA-Z0-9_-]{1,64}):\d{1,6}")
# An id longer than this without its argument marker is not an id.
_MAX_ID_CHARS = 128


class _State(Enum):
    TEXT = auto()  # content, looking for the section
    SECTION = auto()  # between calls
    CALL_ID = auto()  # after CALL_BEGIN, reading the id
    ARGUMENTS = auto()  # after ARGUMENT_BEGIN
    RAW = auto()  # after a malformed call: everything is content


class KimiK2ToolParser:
    def __init__(self, tool_names: Collection[str]) -> None:
        self._tool_names = frozenset(tool_names)
        self._buffer = ""
        self._state = _State.TEXT
        self._call_text = ""  # the current call as written, shown if it proves malformed
        self._call_id = ""
        self._content = ContentGate()

    def feed(self, text: str) -> OutputDelta:
        self._buffer += text
        return self._drain(final=False)

    def finish(self) -> OutputDelta:
        out = self._drain(final=True)
        if self._state in (_State.CALL_ID, _State.ARGUMENTS):
            self._malformed(out)  # cut off mid-call (max_tokens): the call is not made
        out.content += self._content.text(self._buffer) + self._content.finish()
        self._buffer = ""
        return out

    def _drain(self, *, final: bool) -> OutputDelta:
        out = OutputDelta()
        step = {
            _State.TEXT: self._text,
            _State.SECTION: self._section,
            _State.CALL_ID: self._id,
            _State.ARGUMENTS: self._arguments,
            _State.RAW: self._raw,
        }
        while step[self._state](out, final):
            pass
        return out

    def _consume(self, count: int) -> str:
        taken, self._buffer = self._buffer[:count], self._buffer[count:]
        return taken

    def _text(self, out: OutputDelta, final: bool) -> bool:
        start = self._buffer.find(SECTION_BEGIN)
        if start >= 0:
            out.content += self._content.text(self._consume(start))
            self._consume(len(SECTION_BEGIN))
            self._state = _State.SECTION
            return True
        keep = 0 if final else partial_marker_length(self._buffer, (SECTION_BEGIN,))
        out.content += self._content.text(self._consume(len(self._buffer) - keep))
        return False

    def _section(self, out: OutputDelta, final: bool) -> bool:
        stripped = self._buffer.lstrip()
        for marker, state in ((CALL_BEGIN, _State.CALL_ID), (SECTION_END, _State.TEXT)):
            if stripped.startswith(marker):
                self._consume(len(self._buffer) - len(stripped) + len(marker))
                self._call_text = marker
                self._state = state
                return True
        if not final and any(marker.startswith(stripped) for marker in (CALL_BEGIN, SECTION_END)):
            return False
        # Text inside the section that is no call: content, and the section is over.
        self._state = _State.RAW
        return True

    def _id(self, out: OutputDelta, final: bool) -> bool:
        end = self._buffer.find(ARGUMENT_BEGIN)
        if end < 0:
            if len(self._buffer) > _MAX_ID_CHARS:
                return self._malformed(out)
            return False
        self._call_id = self._buffer[:end].strip()
        self._call_text += self._consume(end + len(ARGUMENT_BEGIN))
        if not _CALL_ID.fullmatch(self._call_id):
            return self._malformed(out)
        self._state = _State.ARGUMENTS
        return True

    def _arguments(self, out: OutputDelta, final: bool) -> bool:
        body = self._buffer.lstrip()
        try:
            end = json_object_end(body)
        except NotAnObject:
            return self._malformed(out)
        if end is None:
            return False
        rest = body[end:].lstrip()
        if not rest.startswith(CALL_END):
            if CALL_END.startswith(rest) and not final:
                return False
            return self._malformed(out)
        match = _CALL_ID.fullmatch(self._call_id)
        assert match is not None  # checked in _id
        try:
            arguments = json.loads(body[:end])
        except json.JSONDecodeError:
            return self._malformed(out)
        delta = call_delta(self._content.calls, self._call_id, match["name"], arguments, self._tool_names)
        if delta is None:
            return self._malformed(out)
        out.tool_calls.append(delta)
        self._content.call_made()
        self._consume(len(self._buffer) - len(rest) + len(CALL_END))
        self._state = _State.SECTION
        return True

    def _raw(self, out: OutputDelta, final: bool) -> bool:
        out.content += self._content.text(self._consume(len(self._buffer)))
        return False

    def _malformed(self, out: OutputDelta) -> bool:
        out.content += self._content.text(self._call_text)
        self._call_text = ""
        self._state = _State.RAW
        return True
