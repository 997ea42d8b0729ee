"""Stop strings in the router: hold back what may become one, cut where the engine says one matched.

The engine is the one place stop strings are matched (``cachet.engine.stop_strings``): it
must stop generating at the token that completes one, so it matches them anyway, and its last
message names the one that ended the output (``matched_stop``). But it speaks tokens: the text
before the stop string went out in earlier messages, and the token that completes it may carry
text past it. The router, which turns the tokens into text, does what is left, and matches
nothing itself (OpenAI's semantics: the stop string is not shown, nor anything after it, and a
stream never shows text that then turns out to be part of one):

- while the output streams, it holds back the tail of the text that could still become a stop
  string, and releases it once it cannot;
- on the engine's last message, it cuts that held text and the last delta where the named stop
  string begins.

::

    shown ......... | held (a stop string's start?) | last delta
                      `-- first occurrence of matched_stop --...--> cut here

The first occurrence in the held text and the last delta is where the engine matched: the
engine stops at the first token whose text completes any stop string, so none is complete
before the last delta, and whatever was shown cannot start one (it was held otherwise). A named
stop string that is not there at all means the two decoded the text apart (the router keeps
special tokens a parser reads, the engine's decode skips them): the text is kept whole.
"""

from __future__ import annotations

from collections.abc import Sequence


class StopStringHoldBack:
    """Feed one output's text deltas in order, then its last one; get back the text to show."""

    def __init__(self, stops: Sequence[str]) -> None:
        self._stops = tuple(stop for stop in stops if stop)
        self._longest = max(map(len, self._stops), default=0)
        self._held = ""

    def feed(self, text: str) -> str:
        """The text that can no longer turn out to be part of a stop string; the rest is held."""
        buffer = self._held + text
        keep = self._partial_stop_suffix(buffer)
        self._held = buffer[len(buffer) - keep :]
        return buffer[: len(buffer) - keep]

    def finish(self, text: str, matched_stop: str) -> str:
        """The last text, with what was held: up to ``matched_stop`` (the engine's ``matched_stop``,
        "" when no stop string ended the output), all of it otherwise."""
        buffer, self._held = self._held + text, ""
        start = buffer.find(matched_stop) if matched_stop else -1
        return buffer[:start] if start >= 0 else buffer

    def _partial_stop_suffix(self, buffer: str) -> int:
        """Length of the longest tail of ``buffer`` that is a proper prefix of some stop string."""
        for size in range(min(self._longest - 1, len(buffer)), 0, -1):
            tail = buffer[-size:]
            if any(stop.startswith(tail) for stop in self._stops):
                return size
        return 0
