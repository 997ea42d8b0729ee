"""Stop strings over streamed text: never show a stop string, nor anything after it.

The engine stops generating when a stop string appears (and names it in
``matched_stop``), but it works in tokens: the token that completes a stop string
may carry text past it, and the text before the match arrives in earlier deltas.
So the router holds back any tail of the text that could still become a stop
string, releases it once it cannot, and truncates at the first match.
"""

from __future__ import annotations

from collections.abc import Sequence


class StopStringFilter:
    """Feed text deltas in order; get back the text that is safe to show.

    After a match, ``matched`` names the stop string and every later feed returns "".
    """

    def __init__(self, stops: Sequence[str]) -> None:
        self._stops = tuple(stop for stop in stops if stop)
        self._held = ""
        self.matched: str | None = None

    def feed(self, text: str) -> str:
        if self.matched is not None or not self._stops:
            return "" if self.matched is not None else text
        buffer = self._held + text
        match = self._first_match(buffer)
        if match is not None:
            start, self.matched = match
            self._held = ""
            return buffer[:start]
        keep = self._longest_partial_suffix(buffer)
        self._held = buffer[len(buffer) - keep :]
        return buffer[: len(buffer) - keep]

    def flush(self) -> str:
        """The held-back text, once no more text will come (it did not become a stop)."""
        held, self._held = self._held, ""
        return "" if self.matched is not None else held

    def _first_match(self, buffer: str) -> tuple[int, str] | None:
        found = [(buffer.find(stop), stop) for stop in self._stops]
        hits = [(start, stop) for start, stop in found if start >= 0]
        # The earliest start wins: that is where the output would have ended token by token.
        return min(hits, key=lambda hit: hit[0]) if hits else None

    def _longest_partial_suffix(self, buffer: str) -> int:
        # Length of the longest tail of ``buffer`` that is a proper prefix of some stop string.
        longest = max(len(stop) for stop in self._stops) - 1
        for size in range(min(longest, len(buffer)), 0, -1):
            tail = buffer[-size:]
            if any(stop.startswith(tail) for stop in self._stops):
                return size
        return 0
