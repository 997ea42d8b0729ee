"""KV retention: prefixes a caller asked to keep (OpenAI's ``prompt_cache_retention``, Anthropic's
``cache_control`` ttl, the router's default for sessions) outlast other KV for a while.

A request carries its retention as ``KvRetention`` spans (seconds, and how many leading tokens
each covers). When the request leaves the pool (it ended or was preempted), every full, named
block of those spans is put under retention until ``now + seconds``; another request ending
with the same blocks only extends that. The deadline counts from the last use, as OpenAI's and
Anthropic's caches do ("5 minutes of inactivity").

What retention changes is only the order in which a tier gives blocks up: a block under a live
retention goes after every evictable block without one, and among retained blocks the one
whose retention ends first goes first; once a retention ends, the block goes on as if last used
then. Nothing is ever refused for lack of room: a pool full of retained blocks still evicts
them. ``RetainedKeys`` is that order, shared by the block pool (keyed by block id: its
evictable blocks are the free ones) and the host tier (keyed by block hash: every held block
not locked by this step's copies). The shared file tier keeps its retention in the files
themselves (``shared_kv_tier``), where every replica's clean-up sees it.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass

# A caller may ask for at most this (OpenAI's longest, "24h"): a retention is a promise the
# whole replica keeps, and an unbounded one would pin blocks for good.
MAX_RETENTION_SECONDS = 24 * 3600


@dataclass(frozen=True)
class KvRetention:
    """Keep the KV of a request's first ``num_tokens`` tokens (0: all of them, its output too)
    for ``seconds`` after the request last used it. Only whole blocks are retained: a block cut
    by ``num_tokens`` also holds tokens past it, so no later prefix up to it could hit it."""

    seconds: float
    num_tokens: int = 0

    def num_blocks(self, num_full_blocks: int, block_size: int) -> int:
        """How many of a request's ``num_full_blocks`` leading blocks this span covers."""
        if self.num_tokens == 0:
            return num_full_blocks
        return min(num_full_blocks, self.num_tokens // block_size)


class RetainedKeys:
    """Keys (block ids, or block hashes) under a retention deadline, in wall-clock seconds; and
    the evictable ones among them, in the order they go: earliest deadline first, equal deadlines
    in the order they became evictable (a request's blocks are freed tail first, so its tail goes
    first and its prefix stays usable longest).

    Both orders are heaps with stale entries skipped when popped, so each operation costs
    O(log n); they are rebuilt when stale entries outnumber live ones.
    """

    def __init__(self) -> None:
        self._until: dict[int, float] = {}
        # Evictable key -> the sequence number of its live entry in ``_queue``.
        self._evictable: dict[int, int] = {}
        self._queue: list[tuple[float, int, int]] = []  # (until, sequence, key)
        self._deadlines: list[tuple[float, int]] = []  # (until, key), for expire()
        self._sequence = itertools.count()

    def __contains__(self, key: int) -> bool:
        return key in self._until

    def __len__(self) -> int:
        return len(self._until)

    @property
    def num_evictable(self) -> int:
        return len(self._evictable)

    def until(self, key: int) -> float | None:
        return self._until.get(key)

    def is_evictable(self, key: int) -> bool:
        return key in self._evictable

    def retain(self, keys: Iterable[int], until: float) -> None:
        """Keep each key until ``until`` at least: a retention only ever grows. An evictable key
        retained longer goes behind the others of its new deadline."""
        current, deadlines, evictable = self._until, self._deadlines, self._evictable
        longer = []
        for key in keys:
            if until <= current.get(key, -math.inf):
                continue
            current[key] = until
            heapq.heappush(deadlines, (until, key))
            if key in evictable:
                longer.append(key)
        self.park(longer)

    def park(self, keys: Iterable[int]) -> None:
        """These retained keys became evictable (freed blocks, held host blocks), in this order."""
        until, evictable, queue, sequence = self._until, self._evictable, self._queue, self._sequence
        for key in keys:
            number = next(sequence)
            evictable[key] = number
            # A key without a retention fails here: only retained keys are ordered by deadline.
            heapq.heappush(queue, (until[key], number, key))
        self._compact()

    def hold(self, keys: Iterable[tuple[int, float]]) -> None:
        """New (key, deadline) pairs, each retained and evictable at once, in this order: as
        ``retain`` then ``park`` of each in turn, for a tier taking in many blocks in one call."""
        for key, until in keys:
            self._add(key, until)
        self._compact()

    def unpark(self, key: int) -> None:
        """``key`` is in use again; its retention stays and counts once it is parked again."""
        del self._evictable[key]

    def forget(self, key: int) -> None:
        self._until.pop(key, None)
        self._evictable.pop(key, None)

    def pop(
        self, *, until_at_most: float = float("inf"), skip: Callable[[int], bool] | None = None
    ) -> tuple[int, float] | None:
        """The evictable key to go first and its deadline; the key leaves this set. None when
        there is none, or when the first one's retention ends after ``until_at_most`` (it
        outranks the caller's block). Keys ``skip`` names (locked this step) stay."""
        aside: list[tuple[float, int, int]] = []
        found = self._pop(until_at_most, skip, aside)
        self.restore(aside)
        return found

    def pop_many(self, count: int) -> list[tuple[int, float]]:
        """The ``count`` evictable keys to go first, in that order, with their deadlines: as that
        many ``pop`` calls, all of which must find one."""
        found: list[tuple[int, float]] = []
        for _ in range(count):
            popped = self._pop(math.inf, None, [])
            if popped is None:
                raise AssertionError(f"asked for {count} evictable keys, found {len(found)}")
            found.append(popped)
        return found

    def exchange(
        self, key: int, until: float, skip: Callable[[int], bool], aside: list[tuple[float, int, int]]
    ) -> int | None:
        """The evictable key that gives its place up to a new ``key`` retained until ``until`` (as
        ``pop(until_at_most=until, skip=skip)``), ``key`` then held (as ``hold``); None when none
        ends early enough, and ``key`` is not held.

        The entries of skipped keys wait in ``aside`` until ``restore``, which the caller owes
        this set after its last exchange of the step: a tier exchanging many blocks in one step
        steps over each locked one once, not once per block."""
        popped = self._pop(until, skip, aside)
        if popped is None:
            return None
        self._add(key, until)
        return popped[0]

    def restore(self, aside: list[tuple[float, int, int]]) -> None:
        """Put back the entries ``exchange`` set aside (stale ones are skipped as ever)."""
        for entry in aside:
            heapq.heappush(self._queue, entry)
        aside.clear()
        self._compact()

    def expire(self, now: float) -> list[int]:
        """End every retention whose deadline is not after ``now``; returns the evictable keys
        among them in their eviction order (they rejoin their tier's plain LRU)."""
        ended = []
        while self._deadlines and self._deadlines[0][0] <= now:
            until, key = heapq.heappop(self._deadlines)
            if self._until.get(key) != until:
                continue
            del self._until[key]
            sequence = self._evictable.pop(key, None)
            if sequence is not None:
                ended.append((until, sequence, key))
        # In the order they would have been evicted: equal deadlines by when they became evictable.
        return [key for _, _, key in sorted(ended)]

    def clear(self) -> None:
        self._until.clear()
        self._evictable.clear()
        self._queue.clear()
        self._deadlines.clear()

    def eviction_order(self) -> list[int]:
        """Evictable keys, first to go first; for tests and debugging."""
        return [
            key
            for key, _ in sorted(self._evictable.items(), key=lambda item: (self._until[item[0]], item[1]))
        ]

    def _add(self, key: int, until: float) -> None:
        """A new key, retained until ``until`` and evictable at once (``_compact`` is the caller's)."""
        if key in self._until:
            raise AssertionError(f"key {key} held while already retained")
        self._until[key] = until
        heapq.heappush(self._deadlines, (until, key))
        number = next(self._sequence)
        self._evictable[key] = number
        heapq.heappush(self._queue, (until, number, key))

    def _pop(
        self, until_at_most: float, skip: Callable[[int], bool] | None, aside: list[tuple[float, int, int]]
    ) -> tuple[int, float] | None:
        """``pop``'s search; the entries of skipped keys go to ``aside``, off the queue."""
        queue, evictable = self._queue, self._evictable
        while queue:
            until, sequence, key = entry = queue[0]
            if evictable.get(key) != sequence:
                heapq.heappop(queue)
                continue
            if until > until_at_most:
                return None
            heapq.heappop(queue)
            if skip is not None and skip(key):
                aside.append(entry)
                continue
            del evictable[key]
            del self._until[key]
            return key, until
        return None

    def _compact(self) -> None:
        live = len(self._until)
        if len(self._deadlines) > 2 * live + 64:
            self._deadlines = [(until, key) for key, until in self._until.items()]
            heapq.heapify(self._deadlines)
        if len(self._queue) > 2 * len(self._evictable) + 64:
            self._queue = [(self._until[key], seq, key) for key, seq in self._evictable.items()]
            heapq.heapify(self._queue)

    def check_invariants(self) -> None:
        assert set(self._evictable) <= set(self._until), (
            f"evictable keys without a retention: {sorted(set(self._evictable) - set(self._until))}"
        )
        queued = {(key, seq) for _, seq, key in self._queue}
        missing = [key for key, seq in self._evictable.items() if (key, seq) not in queued]
        assert not missing, f"evictable keys missing from the eviction queue: {missing}"
        dated = {(key, until) for until, key in self._deadlines}
        undated = [key for key, until in self._until.items() if (key, until) not in dated]
        assert not undated, f"retained keys missing from the deadline heap: {undated}"
