"""A KV tier below an engine's own pool, as the replay models the shared file tier: a set of block
hashes in LRU order, the retained ones apart.

It holds names, not KV: the replay only needs to know whether a block could be loaded instead
of recomputed. ``put`` inserts (or refreshes) a block and evicts past ``capacity``; ``hit``
refreshes a held block. A capacity of 0 holds nothing, so "no tier" needs no special case.

Retention follows the engine's shared tier (``shared_kv_tier``), whose files are ordered by
modification time and whose retained files carry their retention's end as that time: a block
under retention (``retain``) goes only after every unretained one, the earliest-ending first
(the engine's own ``RetainedKeys`` order); a new block never pushes a retained one out (it is
the one dropped), and a hit leaves a retained block where it is (the later of now and its end).
When a retention ends (``end_retention``) the block goes on as if last used then.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

from cachet.engine.kv_retention import RetainedKeys


class LruTier:
    """Block hashes: unretained ones least recently used first, then retained ones."""

    def __init__(self, capacity: int) -> None:
        if capacity < 0:
            raise ValueError("a tier's capacity cannot be negative")
        self.capacity = capacity
        self._blocks: OrderedDict[int, None] = OrderedDict()
        # Every retained hash, all evictable: the tier holds no block in use.
        self._retained = RetainedKeys()

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._blocks or block_hash in self._retained

    def __len__(self) -> int:
        return len(self._blocks) + len(self._retained)

    @property
    def num_retained(self) -> int:
        return len(self._retained)

    def hit(self, block_hash: int) -> bool:
        """True when the tier holds the block; an unretained one is now the most recent."""
        if block_hash in self._blocks:
            self._blocks.move_to_end(block_hash)
            return True
        return block_hash in self._retained

    def put(self, block_hash: int) -> None:
        if not self.capacity or self.hit(block_hash):
            return
        self._blocks[block_hash] = None
        while len(self) > self.capacity:
            if self._blocks:
                self._blocks.popitem(last=False)
            else:
                self._retained.pop()

    def retain(self, block_hashes: Iterable[int], until: float) -> None:
        """Keep the held ones of these blocks until ``until`` at least (a retention only grows);
        the others are not kept for it."""
        if not self.capacity:
            return
        held = [block_hash for block_hash in block_hashes if block_hash in self]
        newly = [block_hash for block_hash in held if block_hash in self._blocks]
        for block_hash in newly:
            del self._blocks[block_hash]
        self._retained.retain(held, until)
        self._retained.park(newly)

    def end_retention(self, now: float) -> None:
        """End the retentions due by ``now``: those blocks become the most recent, the earliest
        ended first. Exact as long as nothing was used between their end and ``now``."""
        for block_hash in self._retained.expire(now):
            self._blocks[block_hash] = None

    def lru_order(self) -> list[int]:
        """Held hashes, next to be evicted first (for tests)."""
        return [*self._blocks, *self._retained.eviction_order()]
