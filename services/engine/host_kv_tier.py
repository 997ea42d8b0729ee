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

Retention (``kv_retention``) carries on here: a block the pool evicted while it was retained
keeps its deadline in this tier. A slot is taken from the unretained blocks first (least
recently used first); an unretained block never pushes out a retained one (it is not kept);
a retained one pushes out the retained block whose retention ends first, if that ends no later
than its own. When a retention ends the block goes on as if last used then (the LRU's tail).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import Any

from cachet.engine.block_pool import KvEvent
from cachet.engine.kv_retention import RetainedKeys
from cachet.engine.step_plan import KvBlockMoves, LoadedBlock
from cachet.engine.tier_events import TierEvents, snapshot


class HostTierIndex:
    """Which block hashes the host tier holds, in which slot, least recently used first (the
    retained ones apart, earliest retention end first)."""

    def __init__(self, num_slots: int, *, events: bool = True) -> None:
        """``events=False``: the tier keeps no KV events (``take_events`` is always empty), for a
        caller that has no follower to publish them to."""
        if num_slots <= 0:
            raise ValueError(f"a host tier needs at least one slot, got {num_slots}")
        self.num_slots = num_slots
        self._slots: OrderedDict[int, int] = OrderedDict()  # unretained hash -> slot, LRU first
        self._retained_slots: dict[int, int] = {}  # retained hash -> slot
        self._retained = RetainedKeys()  # every retained hash, all evictable (locks aside)
        self._free_slots = list(range(num_slots - 1, -1, -1))
        # Hashes whose slots this step's promotions read: their slots are not to be taken.
        self._locked: set[int] = set()
        self._demote: list[tuple[int, int]] = []
        self._promote: list[tuple[int, int]] = []
        self._fill: list[tuple[int, LoadedBlock]] = []
        self._events = TierEvents("host", kept=events)

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._slots or block_hash in self._retained_slots

    def __len__(self) -> int:
        return len(self._slots) + len(self._retained_slots)

    @property
    def num_retained(self) -> int:
        return len(self._retained_slots)

    def retained_until(self, block_hash: int) -> float | None:
        return self._retained.until(block_hash)

    def demote(self, evicted: Iterable[Sequence[Any]]) -> None:
        """Order copies of pool blocks being evicted, oldest first: ``block_pool.EvictedBlock``s,
        or plain (block id, hash) pairs for blocks without retention. A hash already held only
        becomes most recent (and takes the longer retention); with no slot to take, the block is
        not kept.

        One call takes every block an allocation evicted and ends as one call per block would;
        the retentions of the blocks it holds are entered together, and once no free or
        unretained slot is left, the rest go to ``_demote_past_retained`` in one piece."""
        blocks = list(evicted)
        held: list[tuple[int, float]] = []  # retained blocks held by this call, not yet entered
        for i, (block_id, block_hash, *retention) in enumerate(blocks):
            until = retention[0] if retention else 0.0
            if block_hash in self:
                self._refresh(block_hash, until, held)
                continue
            slot = self._take_slot()
            if slot is None:
                self._enter_retained(held)
                self._demote_past_retained(blocks[i:])
                return
            self._hold(block_hash, slot, until, held)
            self._demote.append((block_id, slot))
        self._enter_retained(held)

    def promote(self, block_hashes: Iterable[int], block_ids: Iterable[int]) -> None:
        """Order copies of held blocks into the pool blocks allocated for them."""
        for block_hash, block_id in zip(block_hashes, block_ids, strict=True):
            self._refresh(block_hash, 0.0)
            self._locked.add(block_hash)
            self._promote.append((self._slot_of(block_hash), block_id))

    def end_retention(self, now: float) -> None:
        """End the retentions due by ``now``: those blocks join the LRU as if used then, earliest
        ended first."""
        for block_hash in self._retained.expire(now):
            self._slots[block_hash] = self._retained_slots.pop(block_hash)

    def fill(self, loaded: Iterable[tuple[int, Any]]) -> None:
        """Order blocks loaded from the shared tier, as (hash, block tensor), into slots; a slot
        filled this step is locked like a promoted one (its promotion follows)."""
        for block_hash, block in loaded:
            if block_hash in self:
                self._refresh(block_hash, 0.0)
                continue
            slot = self._take_slot()
            if slot is None:
                return
            self._hold(block_hash, slot, 0.0, [])
            self._locked.add(block_hash)
            self._fill.append((slot, LoadedBlock(block_hash, block)))

    def take_moves(self, store: list[tuple[int, int]] | None = None) -> KvBlockMoves:
        """This step's copy orders, oldest first, with ``store`` orders for the shared tier;
        unlocks the blocks they read."""
        moves = KvBlockMoves(demote=self._demote, promote=self._promote, store=store or [], fill=self._fill)
        self._demote, self._promote, self._fill = [], [], []
        self._locked.clear()
        return moves

    def clear(self) -> None:
        """Forget every held block (a prefix cache reset, between steps)."""
        if self._demote or self._promote or self._fill:
            raise AssertionError("host tier cleared while a step's copy orders are pending")
        self._slots.clear()
        self._retained_slots.clear()
        self._retained.clear()
        self._free_slots = list(range(self.num_slots - 1, -1, -1))
        self._events.cleared()

    def take_events(self) -> list[KvEvent]:
        """The tier's KV events since the last call, oldest first."""
        return self._events.take()

    def snapshot_events(self) -> list[KvEvent]:
        """Every held hash as one stored event, for a new follower."""
        return snapshot("host", [*self._slots, *self._retained_slots])

    def eviction_order(self) -> list[int]:
        """Held hashes, the first to give up its slot first (the unretained least recently used
        first, then the retained, earliest retention end first); for tests and debugging."""
        return [*self._slots, *self._retained.eviction_order()]

    def _slot_of(self, block_hash: int) -> int:
        slot = self._slots.get(block_hash)
        return self._retained_slots[block_hash] if slot is None else slot

    def _hold(self, block_hash: int, slot: int, until: float, held: list[tuple[int, float]]) -> None:
        """A new block in ``slot``; a retained one's retention waits in ``held`` (``_enter_retained``)."""
        self._events.stored(block_hash)
        if until:
            self._retained_slots[block_hash] = slot
            held.append((block_hash, until))
        else:
            self._slots[block_hash] = slot

    def _enter_retained(self, held: list[tuple[int, float]]) -> None:
        """Enter the retentions of blocks ``demote`` holds or holds again, in the order it took
        them in; before any step of it that reads them (a retained slot to take)."""
        if held:
            self._retained.hold(held)
            held.clear()

    def _refresh(self, block_hash: int, until: float, held: list[tuple[int, float]] | None = None) -> None:
        """A held block was used again: most recent in the LRU, and retained at least until
        ``until``; that retention waits in ``held`` when ``demote`` passes its list."""
        if not until:
            if block_hash in self._slots:
                self._slots.move_to_end(block_hash)
            return
        if block_hash in self._slots:
            self._retained_slots[block_hash] = self._slots.pop(block_hash)
        if held is None:
            self._retained.hold([(block_hash, until)])
        else:
            held.append((block_hash, until))

    def _take_slot(self) -> int | None:
        """A free slot, else the least recently used unretained block's (not a locked one)."""
        if self._free_slots:
            return self._free_slots.pop()
        for block_hash, slot in self._slots.items():
            if block_hash not in self._locked:
                del self._slots[block_hash]
                self._events.removed(block_hash)
                return slot
        return None

    def _demote_past_retained(self, blocks: Sequence[Sequence[Any]]) -> None:
        """``demote``'s blocks once every slot is held by a retained or a locked block (which
        lasts the call: nothing here frees or unlocks a slot, or unretains a block): an unretained
        block is not kept, a retained one takes the slot of the retained block whose retention
        ends first, if that ends no later than its own."""
        aside: list[tuple[float, int, int]] = []
        skip = self._locked.__contains__
        for block_id, block_hash, *retention in blocks:
            until = retention[0] if retention else 0.0
            if block_hash in self._slots or block_hash in self._retained_slots:
                self._refresh(block_hash, until)
                continue
            out = self._retained.exchange(block_hash, until, skip, aside) if until else None
            if out is None:
                continue
            self._events.removed(out)
            slot = self._retained_slots.pop(out)
            self._events.stored(block_hash)
            self._retained_slots[block_hash] = slot
            self._demote.append((block_id, slot))
        self._retained.restore(aside)

    def check_invariants(self) -> None:
        """Raise AssertionError naming the first broken invariant."""
        both = set(self._slots) & set(self._retained_slots)
        assert not both, f"hashes both retained and not: {sorted(both)}"
        slots = [*self._slots.values(), *self._retained_slots.values(), *self._free_slots]
        assert len(slots) == self.num_slots and set(slots) == set(range(self.num_slots)), (
            f"slots held or free: {sorted(slots)}"
        )
        unretained = [h for h in self._retained_slots if h not in self._retained]
        assert not unretained, f"retained slots of {unretained} have no retention"
        assert len(self._retained) == len(self._retained_slots), (
            f"{len(self._retained)} retentions for {len(self._retained_slots)} retained blocks"
        )
        assert self._retained.num_evictable == len(self._retained_slots), "a retained block is not evictable"
        self._retained.check_invariants()
