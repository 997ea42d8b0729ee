"""One tool call read as the model writes it, its arguments streamed as they come.

``ArgumentsStream`` passes on the text of one arguments object, fragment by
fragment, and knows where it ends (strings and nesting tracked, so braces inside
values do not end it). ``CallObjectReader`` reads a ``{"name": ..., "arguments":
{...}}`` object (Hermes blocks, the items of a forced ``required`` array):

- ``name`` first, then ``arguments`` opening as an object: the call is announced
  at that point (header: id and name) and the arguments text streams as written;
  anything after the arguments, up to the object's ``}``, is not part of them.
- any other shape (keys the other way round, arguments written as a JSON
  string): read whole, then sent as a header and one fragment.

Before the call is announced it may still prove malformed (unknown function, not
JSON): the reader says so and its caller shows the text as content. After that
the call stands: output cut short leaves it with the arguments written so far
(the finish reason says ``length``), as OpenAI's own stream would.
"""

from __future__ import annotations

import json
import re
from collections.abc import Collection
from enum import Enum, auto

from cachet.router.output_parser import OutputDelta
from cachet.router.tool_parsers.text_scan import NotAnObject, ObjectScanner, json_object_end, object_opened
from cachet.router.tool_parsers.tool_calls import fragment, header, is_offered, new_call_id, whole_call

# {"name": "<name>", "arguments": ...up to the arguments' "{" (not consumed).
_NAME_THEN_ARGUMENTS = re.compile(r'\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*(?=\{)')


class ArgumentsStream:
    """The text of one arguments object, passed on as it arrives; the first character fed is its ``{``."""

    def __init__(self, index: int) -> None:
        self._index = index
        self._scanner = ObjectScanner()
        self.done = False

    def feed(self, text: str, out: OutputDelta) -> str:
        """Add the part of ``text`` inside the object to ``out``; return the text after it."""
        end = self._scanner.feed(text)
        if end is not None:
            self.done = True
            text, rest = text[:end], text[end:]
        else:
            rest = ""
        if text:
            out.tool_calls.append(fragment(self._index, text))
        return rest


class Progress(Enum):
    WAITING = auto()  # more text needed
    DONE = auto()  # the object was read; ``rest`` holds the text after it
    MALFORMED = auto()  # not a call: nothing was announced, the caller shows the text as content


class CallObjectReader:
    """One ``{"name", "arguments"}`` call object as call ``index``."""

    def __init__(self, index: int, tool_names: Collection[str]) -> None:
        self._index = index
        self._tool_names = tool_names
        self._unannounced = ""  # text before the call was announced (all of it is needed to judge it)
        self._arguments: ArgumentsStream | None = None
        self._after_arguments: ObjectScanner | None = None
        self.rest = ""

    @property
    def announced(self) -> bool:
        return self._arguments is not None

    def feed(self, text: str, out: OutputDelta, *, final: bool) -> Progress:
        if self._arguments is None:
            self._unannounced += text
            return self._start(out, final)
        return self._continue(self._arguments, text, out, final)

    def _start(self, out: OutputDelta, final: bool) -> Progress:
        body = self._unannounced.lstrip()
        head = _NAME_THEN_ARGUMENTS.match(body)
        if head is not None:
            arguments = body[head.end() :]
            opened = object_opened(arguments)
            if opened is None:
                return Progress.MALFORMED if final else Progress.WAITING
            name = _json_string(head[1])
            if not opened or not is_offered(name, self._tool_names):
                return Progress.MALFORMED
            assert name is not None
            out.tool_calls.append(header(self._index, new_call_id(), name))
            self._arguments = ArgumentsStream(self._index)
            self._unannounced = ""
            return self._continue(self._arguments, arguments, out, final)
        return self._whole(body, out, final)

    def _continue(self, arguments: ArgumentsStream, text: str, out: OutputDelta, final: bool) -> Progress:
        if not arguments.done:
            text = arguments.feed(text, out)
            if not arguments.done:
                return Progress.DONE if final else Progress.WAITING
            self._after_arguments = ObjectScanner(depth=1)
        assert self._after_arguments is not None
        end = self._after_arguments.feed(text)
        if end is None:
            # Inside the call object past its arguments: nothing there belongs to the answer.
            return Progress.DONE if final else Progress.WAITING
        self.rest = text[end:]
        return Progress.DONE

    def _whole(self, body: str, out: OutputDelta, final: bool) -> Progress:
        try:
            end = json_object_end(body)
        except NotAnObject:
            return Progress.MALFORMED
        if end is None:
            return Progress.MALFORMED if final else Progress.WAITING
        try:
            payload = json.loads(body[:end])
        except json.JSONDecodeError:
            return Progress.MALFORMED
        deltas = whole_call(
            self._index, new_call_id(), payload.get("name"), payload.get("arguments", {}), self._tool_names
        )
        if deltas is None:
            return Progress.MALFORMED
        out.tool_calls.extend(deltas)
        self.rest = body[end:]
        return Progress.DONE


def _json_string(escaped: str) -> str | None:
    try:
        return json.loads(f'"{escaped}"')
    except json.JSONDecodeError:
        return None
