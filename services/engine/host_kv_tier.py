"""The host KV tier: blocks evicted from the engine's pool wait in host memory, and a
prefix hit there is copied back instead of recomputed. This is the scheduler's half.

Two halves, split the way the engine is:

* ``HostTierIndex`` lives with the scheduler (rank 0). It names host slots by the chained
  block hash the pool uses, keeps them in LRU order, and turns pool evictions and prefix
  hits into copy orders (``KvBlockMoves``) that travel in the step plan.
* ``host_kv_blocks.HostKvBlocks`` lives with each model runner (every rank of a sharded
  replica holds its own shard of each block) and carries the orders out before the
  step's forward pass: demotions first (the evicted block is about to be overwritten by
  this very step), then promotions.

The tier is inclusive: a promoted block keeps its host slot, so evicting it again costs no
copy. A slot read by a promotion is locked until the plan that carries the order is built:
a demotion in the same step must not overwrite it before the runner has read it.

Every hash the tier gains or loses is a KV event of tier ``"host"`` (``take_events``), so the
cache index goes on finding a block the pool evicted: the pool reports it removed, this
tier stored, and the router still sends its prefix where the copy back is cheap.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from typing import Any

from cachet.engine.block_pool import KvEvent
from cachet.engine.step_plan import KvBlockMoves
from cachet.engine.tier_events import TierEvents, snapshot


class HostTierIndex:
    """Which block hashes the host tier holds, in which slot, least recently used first."""

    def __init__(self, num_slots: int) -> None:
        if num_slots <= 0:
            raise ValueError(f"a host tier needs at least one slot, got {num_slots}")
        self.num_slots = num_slots
        self._slots: OrderedDict[int, int] = OrderedDict()  # hash -> slot, LRU first
        self._free_slots = list(range(num_slots - 1, -1, -1))
        self._locked: set[int] = set()
        self._demote: list[tuple[int, int]] = []
        self._promote: list[tuple[int, int]] = []
        self._fill: list[tuple[int, Any]] = []
        self._events = TierEvents("host")

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._slots

    def __len__(self) -> int:
        return len(self._slots)

    def demote(self, evicted: Iterable[tuple[int, int]]) -> None:
        """Order copies of pool blocks being evicted, given as (block id, hash). A hash already
        held only becomes most recent; with every slot locked, the block is not kept."""
        for block_id, block_hash in evicted:
            if block_hash in self._slots:
                self._slots.move_to_end(block_hash)
                continue
            slot = self._take_slot()
            if slot is None:
                continue
            self._slots[block_hash] = slot
            self._events.stored(block_hash)
            self._demote.append((block_id, slot))

    def promote(self, block_hashes: Iterable[int], block_ids: Iterable[int]) -> None:
        """Order copies of held blocks into the pool blocks allocated for them."""
        for block_hash, block_id in zip(block_hashes, block_ids, strict=True):
            slot = self._slots[block_hash]
            self._slots.move_to_end(block_hash)
            self._locked.add(slot)
            self._promote.append((slot, block_id))

    def fill(self, loaded: Iterable[tuple[int, Any]]) -> None:
        """Order blocks loaded from the shared tier, as (hash, block tensor), into slots; a slot
        filled this step is locked like a promoted one (its promotion follows)."""
        for block_hash, block in loaded:
            if block_hash in self._slots:
                self._slots.move_to_end(block_hash)
                continue
            slot = self._take_slot()
            if slot is None:
                return
            self._slots[block_hash] = slot
            self._events.stored(block_hash)
            self._locked.add(slot)
            self._fill.append((slot, block))

    def take_moves(self, store: list[tuple[int, int]] | None = None) -> KvBlockMoves:
        """This step's copy orders, oldest first, with ``store`` orders for the shared tier;
        unlocks the slots they read."""
        moves = KvBlockMoves(demote=self._demote, promote=self._promote, store=store or [], fill=self._fill)
        self._demote, self._promote, self._fill = [], [], []
        self._locked.clear()
        return moves

    def clear(self) -> None:
        """Forget every held block (a prefix cache reset, between steps)."""
        if self._demote or self._promote or self._fill:
            raise AssertionError("host tier cleared while a step's copy orders are pending")
        self._slots.clear()
        self._free_slots = list(range(self.num_slots - 1, -1, -1))
        self._events.cleared()

    def take_events(self) -> list[KvEvent]:
        """The tier's KV events since the last call, oldest first."""
        return self._events.take()

    def snapshot_events(self) -> list[KvEvent]:
        """Every held hash as one stored event, for a new follower."""
        return snapshot("host", self._slots)

    def _take_slot(self) -> int | None:
        if self._free_slots:
            return self._free_slots.pop()
        for block_hash, slot in self._slots.items():
            if slot not in self._locked:
                del self._slots[block_hash]
                self._events.removed(block_hash)
                return slot
        return None
