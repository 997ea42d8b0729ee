"""The KV events of a lower tier (host memory, shared files), which gains and loses blocks one by
one rather than in prefix runs as the pool does.

Consecutive changes of one kind are folded into one event, and the order between kinds is
kept: a hash removed and stored again in one step (a one-slot tier) must end stored in the
follower's mirror. Not thread-safe: the shared tier's worker guards it with its own lock.

A tier whose events nobody follows (``cachet replay``'s host tiers, which the replayed index
does not see) keeps none: ``kept=False`` drops each change as it comes, so a full tier that
alternates removals and stores does not build millions of one-hash events to throw away.
"""

from __future__ import annotations

from collections.abc import Iterable

from cachet.engine.block_pool import AllBlocksCleared, BlocksRemoved, BlocksStored, KvEvent, KvTier


class TierEvents:
    """Pending events of one tier, oldest first, until ``take``."""

    def __init__(self, tier: KvTier, *, kept: bool = True) -> None:
        self.tier = tier
        self.kept = kept
        # (stored?, hashes) runs; None marks a clear.
        self._runs: list[tuple[bool, list[int]] | None] = []

    def stored(self, block_hash: int) -> None:
        if self.kept:
            self._add(True, block_hash)

    def removed(self, block_hash: int) -> None:
        if self.kept:
            self._add(False, block_hash)

    def cleared(self) -> None:
        # What came before a clear no longer matters to a follower.
        self._runs = [None] if self.kept else []

    def __bool__(self) -> bool:
        return bool(self._runs)

    def take(self) -> list[KvEvent]:
        runs, self._runs = self._runs, []
        return [self._event(run) for run in runs]

    def _add(self, stored: bool, block_hash: int) -> None:
        last = self._runs[-1] if self._runs else None
        if last is not None and last[0] == stored:
            last[1].append(block_hash)
        else:
            self._runs.append((stored, [block_hash]))

    def _event(self, run: tuple[bool, list[int]] | None) -> KvEvent:
        if run is None:
            return AllBlocksCleared(self.tier)
        stored, hashes = run
        return (
            BlocksStored(tuple(hashes), None, self.tier)
            if stored
            else BlocksRemoved(tuple(hashes), self.tier)
        )


def snapshot(tier: KvTier, block_hashes: Iterable[int]) -> list[KvEvent]:
    """A new follower's view of a tier: every block it holds, as one stored event (none if empty)."""
    ordered = tuple(sorted(block_hashes))
    return [BlocksStored(ordered, None, tier)] if ordered else []
