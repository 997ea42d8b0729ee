"""A KV tier below an engine's own pool, as the replay models it: a set of block hashes in LRU order.

It holds names, not KV: the replay only needs to know whether a block could be
loaded instead of recomputed. ``put`` inserts (or refreshes) a block and evicts
the least recently used past ``capacity``; ``hit`` refreshes a held block. A
capacity of 0 holds nothing, so "no tier" needs no special case.
"""

from __future__ import annotations

from collections import OrderedDict


class LruTier:
    """Block hashes, least recently used first."""

    def __init__(self, capacity: int) -> None:
        if capacity < 0:
            raise ValueError("a tier's capacity cannot be negative")
        self.capacity = capacity
        self._blocks: OrderedDict[int, None] = OrderedDict()

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._blocks

    def __len__(self) -> int:
        return len(self._blocks)

    def hit(self, block_hash: int) -> bool:
        """True (and the block is now the most recent) when the tier holds it."""
        if block_hash not in self._blocks:
            return False
        self._blocks.move_to_end(block_hash)
        return True

    def put(self, block_hash: int) -> None:
        if not self.capacity:
            return
        self._blocks[block_hash] = None
        self._blocks.move_to_end(block_hash)
        while len(self._blocks) > self.capacity:
            self._blocks.popitem(last=False)

    def lru_order(self) -> list[int]:
        """Held hashes, next to be evicted first (for tests)."""
        return list(self._blocks)
