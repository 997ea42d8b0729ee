"""Hermes / Qwen style tool calls: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``.

The format Cachet's generic tool rendering teaches models whose templates know no
tools (``cachet.tokenizer.generic_tool_prompt``), and the one Hermes- and
Qwen-trained models write on their own. Text outside call blocks is content.

A block's object is read by ``streamed_call.CallObjectReader``: the call is
announced (id, name) once its name is an offered tool and its arguments have
opened as an object, then the arguments stream as written; the closing tag
follows the object. A block that proves no call before that (not JSON, unknown
name, no object by the end) goes out as content, tag included, and the text after
the tag is scanned again. Text after an announced call's object that is not the
closing tag is content.
"""

from __future__ import annotations

from collections.abc import Collection

from cachet.router.output_parser import OutputDelta
from cachet.router.tool_parsers.content_gate import ContentGate
from cachet.router.tool_parsers.streamed_call import CallObjectReader, Progress
from cachet.router.tool_parsers.text_scan import partial_marker_length

OPEN = "<tool_call>"
CLOSE = "</tool_call>"


class HermesToolParser:
    def __init__(self, tool_names: Collection[str]) -> None:
        self._tool_names = frozenset(tool_names)
        self._buffer = ""  # text not yet shown or parsed
        self._call: CallObjectReader | None = None  # the block being read (its opening tag consumed)
        self._block_text = ""  # the block's text while its call is unannounced, shown if it is none
        self._closing = False  # the call object was read; its closing tag is expected
        self._content = ContentGate()

    def feed(self, text: str) -> OutputDelta:
        self._buffer += text
        return self._drain(final=False)

    def finish(self) -> OutputDelta:
        out = self._drain(final=True)
        out.content += self._content.finish()
        return out

    def _drain(self, *, final: bool) -> OutputDelta:
        out = OutputDelta()
        while True:
            if self._closing:
                if not self._close_block(final):
                    return out
                continue
            if self._call is not None:
                if not self._read_call(self._call, out, final=final):
                    return out
                continue
            start = self._buffer.find(OPEN)
            if start >= 0:
                out.content += self._content.text(self._buffer[:start])
                self._buffer = self._buffer[start + len(OPEN) :]
                self._call = CallObjectReader(self._content.calls, self._tool_names)
                self._block_text = ""
                continue
            keep = 0 if final else partial_marker_length(self._buffer, (OPEN,))
            out.content += self._content.text(self._buffer[: len(self._buffer) - keep])
            self._buffer = self._buffer[len(self._buffer) - keep :]
            return out

    def _read_call(self, call: CallObjectReader, out: OutputDelta, *, final: bool) -> bool:
        """Feed the buffer to the block's call; False to wait for more text."""
        text, self._buffer = self._buffer, ""
        if not call.announced:
            self._block_text += text
        was_announced = call.announced
        progress = call.feed(text, out, final=final)
        if call.announced and not was_announced:
            self._content.call_made()
        if progress is Progress.MALFORMED:
            # The opening tag was not a call after all: it is content, and the text after it
            # is scanned again (a real call may follow).
            out.content += self._content.text(OPEN)
            self._buffer = self._block_text
            self._call = None
            return True
        if progress is Progress.WAITING:
            return False
        if not call.announced:
            self._content.call_made()  # a call read whole
        self._buffer = call.rest
        self._call = None
        self._closing = True
        return True

    def _close_block(self, final: bool) -> bool:
        """Consume the closing tag; text that is not one stays in the buffer as content."""
        rest = self._buffer.lstrip()
        if rest.startswith(CLOSE):
            self._buffer = rest[len(CLOSE) :]
        elif CLOSE.startswith(rest) and not final:
            return False
        self._closing = False
        return True
