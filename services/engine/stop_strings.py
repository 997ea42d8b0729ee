"""Incremental stop-string matching over generated tokens: the one place stop strings are matched.

The engine must stop at the token that completes a stop string, so it matches them, and names
the one matched in its last message (``matched_stop``); the router, which turns tokens into
text for the caller, only holds back and cuts that text where it is told
(``cachet.router.stop_strings``), and matches nothing itself.

The engine samples token ids; stop strings are text. A stop string may span
several tokens ("end" + "ing"), and a token may end in the middle of a
multi-byte character. So text is decoded incrementally (the one incremental
detokenizer, ``cachet.incremental_detokenizer``, as the router's streams use), and
each new piece is searched together with just enough of the text before it to catch
a stop string that started earlier. Works with any ``decode(list[int]) -> str``,
e.g. ``tokenizers.Tokenizer.decode``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from cachet.incremental_detokenizer import Decode, IncrementalDetokenizer


@dataclass(frozen=True)
class StopMatch:
    """A stop string was generated; text from ``text_end`` on is not output."""

    stop: str
    # Characters of the whole generated text before the stop string.
    text_end: int
    # Characters of the latest text delta to keep (the ones before the stop string).
    keep_chars: int


class StopStringChecker:
    """Feeds generated tokens one at a time; reports the first stop string completed.

    Among stop strings completed by the same delta, the one that starts first
    wins (ties: the earlier in ``stops``). Holds only the last
    ``max(len(stop)) - 1`` characters of text.
    """

    def __init__(self, stops: Sequence[str], decode: Decode, context_token_ids: Sequence[int] = ()) -> None:
        if not stops or not all(stops):
            raise ValueError("stop strings must be non-empty")
        self.stops = tuple(stops)
        self._decoder = IncrementalDetokenizer(decode, context_token_ids)
        self._tail_len = max(map(len, self.stops)) - 1
        self._tail = ""
        self._text_len = 0  # characters of generated text so far (tail included)

    def append(self, token_id: int) -> StopMatch | None:
        """Add one generated token; the stop string it completes, if any."""
        delta = self._decoder.add([token_id])
        if not delta:
            return None
        #   window = [ tail (older text) | delta ]
        #              ^ text offset window_start
        delta_start = len(self._tail)
        window = self._tail + delta
        window_start = self._text_len - delta_start
        self._text_len += len(delta)
        self._tail = window[-self._tail_len :] if self._tail_len else ""
        match = self._find(window, delta_start)
        if match is None:
            return None
        index, stop = match
        return StopMatch(stop, window_start + index, max(0, index - delta_start))

    def _find(self, window: str, delta_start: int) -> tuple[int, str] | None:
        """Earliest stop string in ``window`` that ends inside the delta (older ones were found before)."""
        best: tuple[int, str] | None = None
        for stop in self.stops:
            index = window.find(stop, max(0, delta_start - len(stop) + 1))
            if index >= 0 and (best is None or index < best[0]):
                best = (index, stop)
        return best
