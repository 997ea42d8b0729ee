"""Output of a request whose tool call is forced by grammar (``tool_choice`` named or required).

``tool_choice`` builds the constraints these read (see there):

- named function: the whole output is the arguments object. It streams as it is
  generated (the grammar guarantees it parses, so there is nothing to take back):
  a header (index, id, name) on the first text, then argument text as it comes.
- required: the output is a JSON array of ``{"name", "arguments"}`` objects (the
  grammar writes ``name`` first), each read by ``streamed_call.CallObjectReader``:
  announced once its name is read and its arguments open, then streamed.

Text that does not fit (an engine that did not constrain, or output cut short
before the first call) goes out as content rather than failing the request.
"""

from __future__ import annotations

from collections.abc import Collection

from cachet.router.output_parser import OutputDelta
from cachet.router.tool_parsers.streamed_call import CallObjectReader, Progress
from cachet.router.tool_parsers.tool_calls import fragment, header, new_call_id


class NamedToolCallParser:
    """The output is the arguments of a call to ``name``."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._started = False  # the call's header went out
        self._as_content = False  # the output is not an object: all of it is content
        self._pending = ""  # trailing whitespace, shown only if more text follows

    def feed(self, text: str) -> OutputDelta:
        if self._as_content:
            return OutputDelta(content=text)
        out = OutputDelta()
        if not self._started:
            text = text.lstrip()
            if not text:
                return out
            if text[0] != "{":
                self._as_content = True
                return OutputDelta(content=text)
            self._started = True
            out.tool_calls.append(header(0, new_call_id(), self._name))
        stripped = text.rstrip()
        if not stripped:
            self._pending += text
            return out
        out.tool_calls.append(fragment(0, self._pending + stripped))
        self._pending = text[len(stripped) :]
        return out

    def finish(self) -> OutputDelta:
        return OutputDelta()


class RequiredToolCallsParser:
    """The output is a JSON array of calls, one object each."""

    def __init__(self, tool_names: Collection[str]) -> None:
        self._tool_names = frozenset(tool_names)
        self._buffer = ""
        self._raw = ""  # all output, shown whole when it held no call at all
        self._opened = False  # the array's "[" was read
        self._call: CallObjectReader | None = None
        self._call_text = ""  # the current item while unannounced, shown if it is no call
        self._calls = 0
        self._as_content = False

    def feed(self, text: str) -> OutputDelta:
        if self._as_content:
            return OutputDelta(content=text)
        self._buffer += text
        self._raw += text
        return self._drain(final=False)

    def finish(self) -> OutputDelta:
        if self._as_content:
            return OutputDelta()
        out = self._drain(final=True)
        if self._as_content:
            return out
        rest, self._buffer = self._buffer.strip(), ""
        if rest not in ("", "]"):
            out.content += rest
        return out

    def _drain(self, *, final: bool) -> OutputDelta:
        out = OutputDelta()
        while not self._as_content and self._step(out, final):
            pass
        return out

    def _step(self, out: OutputDelta, final: bool) -> bool:
        if self._call is not None:
            return self._read_call(self._call, out, final)
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
        self._buffer = body
        self._call = CallObjectReader(self._calls, self._tool_names)
        self._call_text = ""
        return True

    def _read_call(self, call: CallObjectReader, out: OutputDelta, final: bool) -> bool:
        text, self._buffer = self._buffer, ""
        if not call.announced:
            self._call_text += text
        progress = call.feed(text, out, final=final)
        if progress is Progress.MALFORMED:
            self._buffer = self._call_text
            return self._give_up(out)
        if progress is Progress.WAITING:
            return False
        self._calls += 1
        self._buffer = call.rest
        self._call = None
        return True

    def _give_up(self, out: OutputDelta) -> bool:
        # Cut short (max_tokens) or not a call: an unfinished item is content, and with no
        # call made at all, so is the whole output.
        out.content += self._buffer if self._calls else self._raw
        self._buffer = ""
        self._as_content = True
        return False
