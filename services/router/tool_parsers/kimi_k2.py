"""Kimi K2 tool calls, in the special tokens its chat template writes::

    <|tool_calls_section_begin|>
    <|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>{json}<|tool_call_end|>
    ...
    <|tool_calls_section_end|>

The call id is the model's own ``functions.NAME:IDX``: the template writes it back
in the next turn (``## Return of <id>``), so it is kept as is rather than replaced
by an OpenAI-style id. Text before the section is content.

A call is announced (id, name) once its id names an offered function and its
arguments have opened as a JSON object; the arguments then stream as written, and
their end is found by tracking JSON strings, so marker text inside an argument
value does not end the call. A call that does not fit the format before that (bad
id, unknown function, arguments not an object) ends parsing: it and all text after
it go out as content. After an announced call, anything but its end marker ends
parsing the same way (the call stands); output cut short leaves the call with the
arguments written so far.

These markers are special tokens: the router must detokenize with special tokens
kept (``selection`` says so for this family).
"""

from __future__ import annotations

import re
from collections.abc import Collection
from enum import Enum, auto

from cachet.router.output_parser import OutputDelta
from cachet.router.tool_parsers.content_gate import ContentGate
from cachet.router.tool_parsers.streamed_call import ArgumentsStream
from cachet.router.tool_parsers.text_scan import object_opened, partial_marker_length
from cachet.router.tool_parsers.tool_calls import header, is_offered

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
    ARGUMENTS = auto()  # after ARGUMENT_BEGIN, before the call is announced
    STREAMING = auto()  # the call announced, its arguments streaming
    CALL_END = auto()  # the arguments ended; their end marker is expected
    RAW = auto()  # after a malformed call: everything is content


class KimiK2ToolParser:
    def __init__(self, tool_names: Collection[str]) -> None:
        self._tool_names = frozenset(tool_names)
        self._buffer = ""
        self._state = _State.TEXT
        self._call_text = ""  # the current call as written, shown if it proves malformed
        self._call_id = ""
        self._arguments: ArgumentsStream | None = None
        self._content = ContentGate()

    def feed(self, text: str) -> OutputDelta:
        self._buffer += text
        return self._drain(final=False)

    def finish(self) -> OutputDelta:
        out = self._drain(final=True)
        if self._state is _State.CALL_ID:
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
            _State.ARGUMENTS: self._open_arguments,
            _State.STREAMING: self._stream_arguments,
            _State.CALL_END: self._call_end,
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

    def _open_arguments(self, out: OutputDelta, final: bool) -> bool:
        body = self._buffer.lstrip()
        opened = object_opened(body)
        if opened is None:
            return self._malformed(out) if final else False
        match = _CALL_ID.fullmatch(self._call_id)
        assert match is not None  # checked in _id
        if not opened or not is_offered(match["name"], self._tool_names):
            return self._malformed(out)
        index = self._content.calls
        out.tool_calls.append(header(index, self._call_id, match["name"]))
        self._content.call_made()
        self._arguments = ArgumentsStream(index)
        self._buffer = body
        self._state = _State.STREAMING
        return True

    def _stream_arguments(self, out: OutputDelta, final: bool) -> bool:
        assert self._arguments is not None
        self._buffer = self._arguments.feed(self._buffer, out)
        if not self._arguments.done:
            return False
        self._state = _State.CALL_END
        return True

    def _call_end(self, out: OutputDelta, final: bool) -> bool:
        rest = self._buffer.lstrip()
        if rest.startswith(CALL_END):
            self._consume(len(self._buffer) - len(rest) + len(CALL_END))
            self._state = _State.SECTION
            return True
        if CALL_END.startswith(rest) and not final:
            return False
        self._state = _State.RAW  # the call stands; what follows is content
        return True

    def _raw(self, out: OutputDelta, final: bool) -> bool:
        out.content += self._content.text(self._consume(len(self._buffer)))
        return False

    def _malformed(self, out: OutputDelta) -> bool:
        out.content += self._content.text(self._call_text)
        self._call_text = ""
        self._state = _State.RAW
        return True
