"""Where the model's text becomes answer content, reasoning and tool calls.

Every parser has two methods: ``feed`` each visible text delta, ``finish`` once
at the end; each returns what to show. ``PlainTextParser`` shows all text as
content; the tool-call and reasoning parsers live in ``cachet.router.tool_parsers``
(``selection`` picks them per request).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from cachet.router.v1 import router_pb2


@dataclass
class OutputDelta:
    """What one piece of model text adds to the answer."""

    content: str = ""
    reasoning: str = ""
    tool_calls: list[router_pb2.ToolCallDelta] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.reasoning or self.tool_calls)


class OutputParser(Protocol):
    def feed(self, text: str) -> OutputDelta: ...

    def finish(self) -> OutputDelta: ...


def merge_deltas(first: OutputDelta, second: OutputDelta) -> OutputDelta:
    return OutputDelta(
        first.content + second.content,
        first.reasoning + second.reasoning,
        [*first.tool_calls, *second.tool_calls],
    )


class PlainTextParser:
    """All text is content."""

    def feed(self, text: str) -> OutputDelta:
        return OutputDelta(content=text)

    def finish(self) -> OutputDelta:
        return OutputDelta()
