"""Hermes / Qwen style tool calls: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``.

The format Cachet's generic tool rendering teaches models whose templates know no
tools (``cachet.tokenizer.generic_tool_prompt``), and the one Hermes- and
Qwen-trained models write on their own. Text outside call blocks is content.

A block is a call when, after the opening tag, a JSON object with a ``name`` of an
offered tool and object ``arguments`` is followed (whitespace aside) by the
closing tag. The object's end is found by tracking JSON strings, so a closing tag
inside an argument value does not end the call. Anything else (not JSON, unknown
name, no closing tag by the end) goes out as content, tag included.
"""

from __future__ import annotations

import json
from collections.abc import Collection

from cachet.router.output_parser import OutputDelta
from cachet.router.tool_parsers.content_gate import ContentGate
from cachet.router.tool_parsers.text_scan import NotAnObject, json_object_end, partial_marker_length
from cachet.router.tool_parsers.tool_calls import call_delta, new_call_id

OPEN = "<tool_call>"
CLOSE = "</tool_call>"


class HermesToolParser:
    def __init__(self, tool_names: Collection[str]) -> None:
        self._tool_names = frozenset(tool_names)
        self._buffer = ""  # text not yet shown or parsed
        self._in_call = False  # the buffer starts inside a block (its opening tag consumed)
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
            if self._in_call:
                if not self._take_call(out, final=final):
                    return out
                continue
            start = self._buffer.find(OPEN)
            if start >= 0:
                out.content += self._content.text(self._buffer[:start])
                self._buffer = self._buffer[start + len(OPEN) :]
                self._in_call = True
                continue
            keep = 0 if final else partial_marker_length(self._buffer, (OPEN,))
            out.content += self._content.text(self._buffer[: len(self._buffer) - keep])
            self._buffer = self._buffer[len(self._buffer) - keep :]
            return out

    def _take_call(self, out: OutputDelta, *, final: bool) -> bool:
        """Consume one block if it is complete; False to wait for more text."""
        body = self._buffer.lstrip()
        try:
            end = json_object_end(body)
        except NotAnObject:
            return self._malformed(out)
        if end is None:
            return self._malformed(out) if final else False
        rest = body[end:].lstrip()
        if not rest.startswith(CLOSE):
            if CLOSE.startswith(rest) and not final:
                return False
            return self._malformed(out)
        try:
            payload = json.loads(body[:end])
        except json.JSONDecodeError:
            return self._malformed(out)
        delta = call_delta(
            self._content.calls,
            new_call_id(),
            payload.get("name"),
            payload.get("arguments", {}),
            self._tool_names,
        )
        if delta is None:
            return self._malformed(out)
        out.tool_calls.append(delta)
        self._content.call_made()
        self._buffer = rest[len(CLOSE) :]
        self._in_call = False
        return True

    def _malformed(self, out: OutputDelta) -> bool:
        # The opening tag was not a call after all: it is content, and the text after it
        # is scanned again (a real call may follow).
        out.content += self._content.text(OPEN)
        self._in_call = False
        return True
