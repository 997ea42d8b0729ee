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

    Both orders are heaps of *runs*: one entry per call (a request's blocks, retained or parked
    together, share a deadline), not one per key, since a request retains and frees its whole
    prefix at once and an agent's next turn does it again. A run's keys are read in order from
    a cursor; a key retained again, used or evicted leaves a stale copy in its old run that is
    skipped when reached. So a call costs one heap push and O(1) per key, a key popped O(1)
    plus its run's share of one heap pop; the heaps are rebuilt when stale keys outnumber live
    ones three to one.
    """

    def __init__(self, *, slack: int = 1024) -> None:
        # Stale keys a heap may hold past three per live one before it is rebuilt (tests: 0).
        self._slack = slack
        self._until: dict[int, float] = {}
        # Evictable key -> its sequence number: the one its copy in ``_queue`` carries.
        self._evictable: dict[int, int] = {}
        # [until, sequence of keys[pos], pos, keys]: a run of keys with one deadline and
        # consecutive sequence numbers, the ones before ``pos`` gone. Entries compare by
        # (until, sequence), which no two share; only the root's cursor moves, and its
        # sequence only grows past keys no other entry holds, so the heap stays a heap.
        self._queue: list[list] = []
        self._deadlines: list[tuple[float, int, list[int]]] = []  # (until, run number, keys), for expire()
        self._sequence = itertools.count()
        self._runs = itertools.count()
        # Keys in the heaps (live or stale), past the queue's cursors: what _compact weighs.
        self._queued = 0
        self._dated = 0
        # The newest run of each heap while it is in the heap: keys that come after it with its
        # deadline (a tier exchanging or holding blocks one by one) join it rather than
        # become runs of their own.
        self._newest_queued: list | None = None
        self._newest_dated: tuple[float, int, list[int]] | None = None

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
        current, evictable = self._until, self._evictable
        grown, longer = [], []
        for key in keys:
            if until <= current.get(key, -math.inf):
                continue
            current[key] = until
            grown.append(key)
            if key in evictable:
                longer.append(key)
        self._date(grown, until)
        self.park(longer)

    def park(self, keys: Iterable[int]) -> None:
        """These retained keys became evictable (freed blocks, held host blocks), in this order."""
        until, evictable, sequence = self._until, self._evictable, self._sequence
        run: list[int] = []
        run_until = 0.0
        for key in keys:
            # A key without a retention fails here: only retained keys are ordered by deadline.
            key_until = until[key]
            if run and key_until != run_until:
                self._queue_run(run, run_until)
                run = []
            run_until = key_until
            evictable[key] = next(sequence)
            run.append(key)
        self._queue_run(run, run_until)
        self._compact()

    def hold(self, keys: Iterable[tuple[int, float]]) -> None:
        """(key, deadline) pairs of a tier whose retained keys are all evictable, in this order:
        a new key is retained and evictable at once, a held one is retained until the deadline
        at least, and either goes behind the others of its deadline when its retention grew; as
        ``retain`` then ``park`` of each in turn, for a tier taking in many blocks in one call."""
        current = self._until
        run: list[int] = []
        run_until = 0.0
        for key, until in keys:
            held = current.get(key)
            if held is not None and until <= held:
                continue
            if run and until != run_until:
                self._add_run(run, run_until)
                run = []
            current[key] = until
            run_until = until
            run.append(key)
        self._add_run(run, run_until)
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
        if key in self._until:
            raise AssertionError(f"key {key} held while already retained")
        self._until[key] = until
        self._add_run([key], until)
        return popped[0]

    def restore(self, aside: list[tuple[float, int, int]]) -> None:
        """Put back the entries ``exchange`` set aside (stale ones are skipped as ever)."""
        for until, sequence, key in aside:
            heapq.heappush(self._queue, [until, sequence, 0, [key]])
        self._queued += len(aside)
        aside.clear()
        self._compact()

    def expire(self, now: float) -> list[int]:
        """End every retention whose deadline is not after ``now``; returns the evictable keys
        among them in their eviction order (they rejoin their tier's plain LRU)."""
        current, evictable, deadlines = self._until, self._evictable, self._deadlines
        ended = []
        while deadlines and deadlines[0][0] <= now:
            entry = heapq.heappop(deadlines)
            until, _, keys = entry
            self._dated -= len(keys)
            if entry is self._newest_dated:
                self._newest_dated = None
            for key in keys:
                if current.get(key) != until:
                    continue
                del current[key]
                sequence = evictable.pop(key, None)
                if sequence is not None:
                    ended.append((until, sequence, key))
        # In the order they would have been evicted: equal deadlines by when they became evictable.
        return [key for _, _, key in sorted(ended)]

    def clear(self) -> None:
        self._until.clear()
        self._evictable.clear()
        self._queue.clear()
        self._deadlines.clear()
        self._queued = self._dated = 0
        self._newest_queued = self._newest_dated = None

    def eviction_order(self) -> list[int]:
        """Evictable keys, first to go first; for tests and debugging."""
        return [
            key
            for key, _ in sorted(self._evictable.items(), key=lambda item: (self._until[item[0]], item[1]))
        ]

    def _date(self, keys: list[int], until: float) -> None:
        """Enter ``keys``' new deadline ``until`` in the deadline heap, as one run."""
        if not keys:
            return
        self._dated += len(keys)
        newest = self._newest_dated
        if newest is not None and newest[0] == until:
            newest[2].extend(keys)
            return
        # A copy: the caller may queue ``keys`` as a run too, and each heap extends its own.
        entry = (until, next(self._runs), list(keys))
        heapq.heappush(self._deadlines, entry)
        self._newest_dated = entry

    def _queue_run(self, keys: list[int], until: float) -> None:
        """Queue evictable ``keys`` (just numbered, in order) as one run, or at the end of the
        newest run when they carry on its deadline and sequence numbers."""
        if not keys:
            return
        self._queued += len(keys)
        sequence = self._evictable[keys[0]]
        newest = self._newest_queued
        if newest is not None and newest[0] == until and newest[1] + len(newest[3]) - newest[2] == sequence:
            newest[3].extend(keys)
            return
        entry = [until, sequence, 0, keys]
        heapq.heappush(self._queue, entry)
        self._newest_queued = entry

    def _add_run(self, keys: list[int], until: float) -> None:
        """Keys just given ``until`` in ``_until``, evictable from now in this order (a key
        already queued leaves a stale copy behind; ``_compact`` is the caller's)."""
        if not keys:
            return
        self._date(keys, until)
        evictable, sequence = self._evictable, self._sequence
        for key in keys:
            evictable[key] = next(sequence)
        self._queue_run(keys, until)

    def _pop(
        self, until_at_most: float, skip: Callable[[int], bool] | None, aside: list[tuple[float, int, int]]
    ) -> tuple[int, float] | None:
        """``pop``'s search; the entries of skipped keys go to ``aside``, off the queue."""
        queue, evictable = self._queue, self._evictable
        while queue:
            entry = queue[0]
            until, sequence, pos, keys = entry
            key = keys[pos]
            if evictable.get(key) == sequence and until > until_at_most:
                return None
            # The root's cursor moves past ``key``, live or stale.
            self._queued -= 1
            if pos + 1 == len(keys):
                if heapq.heappop(queue) is self._newest_queued:
                    self._newest_queued = None
            else:
                entry[1] = sequence + 1
                entry[2] = pos + 1
            if evictable.get(key) != sequence:
                continue
            if skip is not None and skip(key):
                aside.append((until, sequence, key))
                continue
            del evictable[key]
            del self._until[key]
            return key, until
        return None

    def _compact(self) -> None:
        live = len(self._until)
        if self._dated > 4 * live + self._slack:
            by_until: dict[float, list[int]] = {}
            for key, until in self._until.items():
                by_until.setdefault(until, []).append(key)
            self._deadlines = [(until, next(self._runs), keys) for until, keys in by_until.items()]
            self._newest_dated = None
            heapq.heapify(self._deadlines)
            self._dated = live
        if self._queued > 4 * len(self._evictable) + self._slack:
            self._queue = self._queue_runs()
            self._newest_queued = None
            self._queued = len(self._evictable)

    def _queue_runs(self) -> list[list]:
        """The queue without its stale keys: each run's live keys, split where stale ones were
        (a run's sequence numbers must stay consecutive); no sort, the runs keep their order."""
        evictable = self._evictable
        runs: list[list] = []
        for until, sequence, pos, keys in self._queue:
            run: list[int] = []
            for i in range(pos, len(keys)):
                key = keys[i]
                if evictable.get(key) == sequence + i - pos:
                    if not run:
                        runs.append([until, sequence + i - pos, 0, run])
                    run.append(key)
                elif run:
                    run = []
        heapq.heapify(runs)
        return runs

    def check_invariants(self) -> None:
        assert set(self._evictable) <= set(self._until), (
            f"evictable keys without a retention: {sorted(set(self._evictable) - set(self._until))}"
        )
        queued = {
            (key, sequence + i) for _, sequence, pos, keys in self._queue for i, key in enumerate(keys[pos:])
        }
        missing = [key for key, seq in self._evictable.items() if (key, seq) not in queued]
        assert not missing, f"evictable keys missing from the eviction queue: {missing}"
        assert self._queued == sum(len(keys) - pos for _, _, pos, keys in self._queue), (
            "the count of queued keys is off"
        )
        dated = {(key, until) for until, _, keys in self._deadlines for key in keys}
        undated = [key for key, until in self._until.items() if (key, until) not in dated]
        assert not undated, f"retained keys missing from the deadline heap: {undated}"
        assert self._dated == sum(len(keys) for _, _, keys in self._deadlines), (
            "the count of dated keys is off"
        )
