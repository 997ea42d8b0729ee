"""``<think>...</think>`` reasoning (Kimi K2 Thinking / K2.5, DeepSeek R1, Qwen3) apart from the answer.

Wraps the parser of the answer: text inside the think block goes out as
``reasoning`` (streamed as it comes, less a possible half tag), the rest is fed
to the inner parser. A block counts only at the start of the output (after
whitespace), which is where these models write it; ``starts_in_reasoning`` is
for templates whose generation prompt already opened the block (Kimi K2.5 with
thinking on: ``prompt_reasoning`` reads that off the rendered prompt). A block
never closed (max_tokens) is all reasoning, as in vLLM's parsers.
"""

from __future__ import annotations

import re
from enum import Enum, auto

from cachet.router.output_parser import OutputDelta, OutputParser, merge_deltas
from cachet.router.tool_parsers.text_scan import partial_marker_length

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"


class PromptReasoning(Enum):
    """Where the generation prompt leaves the model's think block."""

    UNOPENED = auto()  # the output may open one itself
    OPEN = auto()  # the prompt ends inside one: the output starts as reasoning
    CLOSED = auto()  # the prompt wrote an empty one (thinking off): the output is the answer


_ENDS_OPEN = re.compile(re.escape(THINK_OPEN) + r"\s*\Z")
_ENDS_CLOSED = re.compile(re.escape(THINK_OPEN) + r"\s*" + re.escape(THINK_CLOSE) + r"\s*\Z")


def prompt_reasoning(prompt: str) -> PromptReasoning:
    """Read off the end of a rendered chat prompt (its generation prompt)."""
    if _ENDS_OPEN.search(prompt):
        return PromptReasoning.OPEN
    if _ENDS_CLOSED.search(prompt):
        return PromptReasoning.CLOSED
    return PromptReasoning.UNOPENED


class _State(Enum):
    START = auto()  # not yet known whether the output opens with a think block
    THINKING = auto()
    AFTER = auto()  # right after the block: whitespace before the answer is dropped
    ANSWER = auto()


class ReasoningParser:
    def __init__(self, inner: OutputParser, *, starts_in_reasoning: bool = False) -> None:
        self._inner = inner
        self._buffer = ""
        self._state = _State.THINKING if starts_in_reasoning else _State.START

    def feed(self, text: str) -> OutputDelta:
        if self._state is _State.ANSWER:
            return self._inner.feed(text)
        self._buffer += text
        return self._drain(final=False)

    def finish(self) -> OutputDelta:
        out = self._drain(final=True) if self._state is not _State.ANSWER else OutputDelta()
        return merge_deltas(out, self._inner.finish())

    def _drain(self, *, final: bool) -> OutputDelta:
        out = OutputDelta()
        if self._state is _State.START:
            stripped = self._buffer.lstrip()
            if stripped.startswith(THINK_OPEN):
                self._buffer = stripped[len(THINK_OPEN) :]
                self._state = _State.THINKING
            elif not final and THINK_OPEN.startswith(stripped):
                return out
            else:
                return self._answer(out, self._buffer)
        if self._state is _State.THINKING:
            end = self._buffer.find(THINK_CLOSE)
            if end < 0:
                keep = 0 if final else partial_marker_length(self._buffer, (THINK_CLOSE,))
                out.reasoning += self._buffer[: len(self._buffer) - keep]
                self._buffer = self._buffer[len(self._buffer) - keep :]
                return out
            out.reasoning += self._buffer[:end]
            self._buffer = self._buffer[end + len(THINK_CLOSE) :]
            self._state = _State.AFTER
        # AFTER: the answer starts at its first non-blank character.
        self._buffer = self._buffer.lstrip()
        if not self._buffer:
            return out
        return self._answer(out, self._buffer)

    def _answer(self, out: OutputDelta, text: str) -> OutputDelta:
        self._buffer = ""
        self._state = _State.ANSWER
        return merge_deltas(out, self._inner.feed(text))
