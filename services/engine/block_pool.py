"""A fixed pool of KV block ids: ref counts, an LRU free list, and the hash map
that makes freed-but-intact blocks findable again (prefix caching).

Ownership contract:

* A block with ``ref_count > 0`` is *used*: one reference per request block
  table that holds it. Only the KV cache manager takes (``allocate``,
  ``touch``) and drops (``free``) references.
* A block with ``ref_count == 0`` is *free* and sits in the free list. If it
  carries a hash it is also *cached*: its KV is intact and ``lookup`` finds it,
  until ``allocate`` takes it from the head of the free list and evicts it.
* The hash map holds exactly the blocks that carry a hash, used or free.
* A block that carries a hash may be *retained* until a deadline (``retain``, see
  ``kv_retention``). A free retained block waits apart from the free list and is evicted only
  once the free list is empty, the one whose retention ends first first; when its retention
  ends (``end_retention``) it joins the free list as if freed then. Without retention the
  free list and its order are exactly as above.

Every change to the set of findable hashes is recorded as a ``KvEvent``, in
order, so a follower (the cache service) that replays the events holds
exactly the set ``cached_hashes()``. The events name their tier: the pool's are
``"engine"``; the host and shared tiers emit the same events under their own names, so
one follower mirrors each tier of a replica as its own set.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal, NamedTuple

from cachet.engine.kv_retention import RetainedKeys

# Where a replica holds a block's KV, fastest first: the pool (reused in place), host memory
# (copied back), the shared file tier (read, then copied back).
KvTier = Literal["engine", "host", "shared"]
KV_TIERS: tuple[KvTier, ...] = ("engine", "host", "shared")


@dataclass(frozen=True)
class BlocksStored:
    """Full blocks became findable in ``tier`` under these chained hashes, in prefix order."""

    block_hashes: tuple[int, ...]
    # Hash of the block before the first one; None for a sequence's first block (and for the
    # lower tiers, which gain blocks one by one, out of prefix order).
    parent_block_hash: int | None
    tier: KvTier = "engine"


@dataclass(frozen=True)
class BlocksRemoved:
    """These hashes no longer resolve in ``tier`` (their blocks were evicted from it)."""

    block_hashes: tuple[int, ...]
    tier: KvTier = "engine"


@dataclass(frozen=True)
class AllBlocksCleared:
    """Every hash of ``tier`` was dropped at once (prefix cache reset)."""

    tier: KvTier = "engine"


KvEvent = BlocksStored | BlocksRemoved | AllBlocksCleared


class EvictedBlock(NamedTuple):
    """A cached block ``allocate`` took back: its KV is intact until the step that reuses it runs."""

    block_id: int
    block_hash: int
    # When its retention would have ended (wall-clock seconds); 0.0 for a block without one.
    retained_until: float = 0.0


class NoFreeBlocks(RuntimeError):
    """``allocate`` was asked for more blocks than are free; callers check first."""


class BlockPool:
    """Block ids ``0 .. num_blocks-1`` with ref counts and an LRU of free blocks.

    The free list is an ``OrderedDict`` used as a doubly-linked list: head =
    next to be reused (least recently freed), tail = most recently freed; every
    operation is O(1) per block. Free retained blocks are kept by ``RetainedKeys``
    (O(1) per block and O(log n) per call, in runs), behind the free list.
    """

    def __init__(self, num_blocks: int, *, enable_caching: bool = True) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self._ref_counts = [0] * num_blocks
        self._hashes: list[int | None] = [None] * num_blocks
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._by_hash: dict[int, int] = {}
        self._events: list[KvEvent] = []
        self._evicted: list[EvictedBlock] = []
        self._retained = RetainedKeys()

    # ------------------------------------------------------------------ queries

    @property
    def num_free_blocks(self) -> int:
        """Blocks no request holds (cached-but-free blocks count, retained or not: they are evictable)."""
        return len(self._free) + self._retained.num_evictable

    @property
    def num_retained_blocks(self) -> int:
        """Blocks under a retention, used or free."""
        return len(self._retained)

    def retained_until(self, block_id: int) -> float | None:
        return self._retained.until(block_id)

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def block_hash(self, block_id: int) -> int | None:
        return self._hashes[block_id]

    def lookup(self, block_hash: int) -> int | None:
        """The block cached under ``block_hash``, used or free, or None."""
        return self._by_hash.get(block_hash)

    def cached_hashes(self) -> set[int]:
        return set(self._by_hash)

    def free_block_ids(self) -> list[int]:
        """Free blocks in eviction order (head first, retained ones last); for tests and debugging."""
        return list(self._free) + self._retained.eviction_order()

    # -------------------------------------------------------------- ref counts

    def allocate(self, num_blocks: int) -> list[int]:
        """Take ``num_blocks`` blocks from the free-list head, then, if it runs out, retained
        free blocks (earliest retention end first), each with ref count 1.

        Cached blocks taken this way are evicted: their hashes are dropped and
        reported in one ``BlocksRemoved`` event, and ``EvictedBlock``s wait in
        ``take_evicted`` for a lower tier. The caller owns the references.
        """
        if num_blocks > self.num_free_blocks:
            raise NoFreeBlocks(f"asked for {num_blocks} blocks, {self.num_free_blocks} free")
        plain = min(num_blocks, len(self._free))
        block_ids = [self._free.popitem(last=False)[0] for _ in range(plain)]
        evicted = [EvictedBlock(b, h) for b in block_ids if (h := self._drop_hash(b)) is not None]
        for block_id, until in self._retained.pop_many(num_blocks - plain):
            block_hash = self._drop_hash(block_id)
            assert block_hash is not None, f"retained block {block_id} carries no hash"
            evicted.append(EvictedBlock(block_id, block_hash, until))
            block_ids.append(block_id)
        if evicted:
            self._events.append(BlocksRemoved(tuple(e.block_hash for e in evicted)))
            self._evicted.extend(evicted)
        for block_id in block_ids:
            self._ref_counts[block_id] = 1
        return block_ids

    def touch(self, block_ids: Iterable[int]) -> None:
        """Take one more reference on each (cached) block; free ones leave the free list (a
        retained one keeps its retention, which counts again once it is freed)."""
        for block_id in block_ids:
            if self._ref_counts[block_id] == 0:
                if self._retained.is_evictable(block_id):
                    self._retained.unpark(block_id)
                else:
                    del self._free[block_id]
            self._ref_counts[block_id] += 1

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one reference per block, in the given order.

        A block whose count reaches zero joins the free list. One that carries a
        hash goes to the tail (evicted last, so it can still be hit); one without
        goes to the head, because reusing it first costs no cached prefix.
        Callers pass a sequence's blocks tail-first so its tail is evicted first.
        A retained block waits behind the free list instead, until its retention ends.
        """
        parked = []
        for block_id in block_ids:
            if self._ref_counts[block_id] <= 0:
                raise AssertionError(f"block {block_id} freed with ref count {self._ref_counts[block_id]}")
            self._ref_counts[block_id] -= 1
            if self._ref_counts[block_id] == 0:
                if block_id in self._retained:
                    parked.append(block_id)
                    continue
                self._free[block_id] = None
                if self._hashes[block_id] is None:
                    self._free.move_to_end(block_id, last=False)
        self._retained.park(parked)

    # --------------------------------------------------------------- retention

    def retain(self, block_ids: Iterable[int], until: float) -> None:
        """Keep these blocks (each must carry a hash) until ``until`` at least (wall-clock
        seconds): free, they go only after every unretained free block. A free block taken
        off the free list for it keeps its place among the retained by the order of calls."""
        block_ids = list(block_ids)
        unnamed = [b for b in block_ids if self._hashes[b] is None]
        if unnamed:
            raise AssertionError(f"blocks {unnamed} retained without a hash")
        newly_retained_free = [b for b in block_ids if self._ref_counts[b] == 0 and b not in self._retained]
        self._retained.retain(block_ids, until)
        for block_id in newly_retained_free:
            del self._free[block_id]
        self._retained.park(newly_retained_free)

    def end_retention(self, now: float) -> None:
        """End the retentions due by ``now``. The free blocks among them join the free list's
        tail, the earliest ended first, as if freed when their retention ended: the shared
        tier's files, which keep no other time, age from then too, so a retained prefix leaves
        every tier in the same order once its retention is over."""
        for block_id in self._retained.expire(now):
            self._free[block_id] = None

    # ----------------------------------------------------------------- caching

    def cache_blocks(self, block_ids: Sequence[int], hashes: Sequence[int], parent_hash: int | None) -> None:
        """Register used, full blocks under their chained hashes (``hashes[i]`` names ``block_ids[i]``).

        ``parent_hash`` is the hash of the block before ``block_ids[0]`` (None at a
        sequence start). A hash already held by another block is not registered
        again (two requests computed the same prefix at once): that block stays
        unnamed and is reused first once freed. Each run of newly named blocks is
        reported as one ``BlocksStored`` event with its parent.
        """
        if not self.enable_caching:
            return
        run: list[int] = []
        run_parent = parent_hash
        for block_id, block_hash in zip(block_ids, hashes, strict=True):
            if self._hashes[block_id] is not None or self._ref_counts[block_id] == 0:
                raise AssertionError(f"block {block_id} cached twice or while free")
            if block_hash in self._by_hash:
                self._emit_stored(run, run_parent)
                run, run_parent = [], block_hash
                continue
            self._hashes[block_id] = block_hash
            self._by_hash[block_hash] = block_id
            run.append(block_hash)
        self._emit_stored(run, run_parent)

    def reset(self) -> bool:
        """Forget every cached hash, if no block is in use; True when it did. Retained blocks
        rejoin the free list's tail: without a hash nothing is left to retain."""
        if self.num_free_blocks != self.num_blocks:
            return False
        for block_id in self._retained.eviction_order():
            self._free[block_id] = None
        self._retained.clear()
        for block_id in list(self._by_hash.values()):
            self._hashes[block_id] = None
        self._by_hash.clear()
        self._events.append(AllBlocksCleared())
        return True

    def take_evicted(self) -> list[EvictedBlock]:
        """The cached blocks evicted since the last call, oldest first: their KV is intact until
        the step that reuses them runs."""
        evicted, self._evicted = self._evicted, []
        return evicted

    def take_events(self) -> list[KvEvent]:
        """Events since the last call, oldest first; the pool forgets them."""
        events, self._events = self._events, []
        return events

    def _emit_stored(self, run: list[int], parent: int | None) -> None:
        if run:
            self._events.append(BlocksStored(tuple(run), parent))

    def _drop_hash(self, block_id: int) -> int | None:
        block_hash = self._hashes[block_id]
        if block_hash is not None:
            self._hashes[block_id] = None
            del self._by_hash[block_hash]
        return block_hash

    # -------------------------------------------------------------- invariants

    def check_invariants(self) -> None:
        """Raise AssertionError naming the first broken invariant."""
        refs = self._ref_counts
        negative = [b for b, r in enumerate(refs) if r < 0]
        assert not negative, f"negative ref counts on blocks {negative}"
        zero = {b for b, r in enumerate(refs) if r == 0}
        parked = {b for b in range(self.num_blocks) if self._retained.is_evictable(b)}
        assert parked <= zero, f"retained blocks {sorted(parked - zero)} are evictable while in use"
        assert set(self._free) == zero - parked, (
            f"free list {sorted(self._free)} != unretained blocks with ref 0 {sorted(zero - parked)}"
        )
        used = sum(1 for r in refs if r > 0)
        assert used + self.num_free_blocks == self.num_blocks, (
            f"{used} used + {self.num_free_blocks} free != {self.num_blocks} blocks"
        )
        self._retained.check_invariants()
        retained = [b for b in range(self.num_blocks) if b in self._retained]
        unparked = [b for b in retained if refs[b] == 0 and b not in parked]
        assert not unparked, f"free retained blocks {unparked} are not evictable"
        unnamed = [b for b in retained if self._hashes[b] is None]
        assert not unnamed, f"retained blocks {unnamed} carry no hash"
        named = {b: h for b, h in enumerate(self._hashes) if h is not None}
        assert len(named) == len(self._by_hash), (
            f"{len(named)} blocks carry a hash but the hash map has {len(self._by_hash)}"
        )
        for block_hash, block_id in self._by_hash.items():
            assert named.get(block_id) == block_hash, (
                f"hash map sends {block_hash} to block {block_id}, which carries {named.get(block_id)}"
            )
        assert self.enable_caching or not named, "caching is off but blocks carry hashes"
