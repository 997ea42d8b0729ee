"""Where the model's text becomes answer content (and, later, reasoning and tool calls).

Today content is the text as generated. Tool-call and reasoning parsers (a later
issue) take the place of ``PlainTextParser`` with the same two methods: ``feed``
each visible text delta, ``finish`` once at the end; each returns what to show.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from cachet.router.v1 import router_pb2


@dataclass
class OutputDelta:
    """What one piece of model text adds to the answer."""

    content: str = ""
    reasoning: str = ""
    tool_calls: list[router_pb2.ToolCallDelta] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.reasoning or self.tool_calls)


class PlainTextParser:
    """All text is content."""

    def feed(self, text: str) -> OutputDelta:
        return OutputDelta(content=text)

    def finish(self) -> OutputDelta:
        return OutputDelta()
