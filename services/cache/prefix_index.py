"""Which replica holds which KV blocks, and how long a prefix each one can reuse.

The index mirrors every followed engine's set of cached block hashes (the
``BlockPool.cached_hashes()`` of each replica) and answers one question: for a
chain of block hashes, how many *leading* blocks does each replica hold?

Two maps, kept as exact inverses of each other (``check_invariants``):

* ``_blocks``:  replica address -> the hashes it holds (and the model they belong to)
* ``_holders``: block hash -> a bit mask of the replicas that hold it

Each followed replica owns one bit (its *slot*, reused after the replica is
forgotten). A mask rather than a set of addresses per hash because the index is
sized for a million blocks: a ``set`` costs ~216 bytes per distinct hash, a mask
of up to 8 replicas costs nothing (CPython shares the small ints) and a wider
one 28-36 bytes; and intersecting masks is one machine-level AND, which keeps a
2,000-block lookup under a millisecond (``bench/cache_index_bench.py``).

A match walks the query chain once, starting from the holders of block 0 and
shrinking the candidate mask at every block; a replica drops out at the first
block it lacks, and the walk stops when no candidate is left. Each step costs
one dict lookup and one AND, and the walk never looks at a block past the
longest match.

Hashes chain in their parent and fold in the model, so equal hashes mean equal
prefixes of the same model. A replica that holds a block but not its parent
(the engine evicted the parent first) matches only up to the gap: the KV for
the child is useless without the parent's.

Events are applied with set semantics: the engine registers each hash on at
most one block, so "stored" of a held hash and "removed" of an unknown one are
no-ops rather than errors; either way the mirror ends equal to the engine's set.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True, order=True)
class ReplicaMatch:
    """How many leading blocks of a query one replica holds (at least one)."""

    address: str
    matched_blocks: int


@dataclass
class _ReplicaBlocks:
    # This replica's bit in the ``_holders`` masks (1 << slot).
    bit: int
    # Model of the replica's blocks; "" until the first stored event names it.
    model: str = ""
    hashes: set[int] = field(default_factory=set)


@dataclass
class IndexFigures:
    """Counters since start; the metrics collector and tests read these."""

    lookups: int = 0
    # Sum over lookups of the longest match: blocks the best replica could reuse.
    hit_blocks: int = 0


class PrefixIndex:
    """The mirror of every replica's cached block hashes. Not thread-safe: one event loop owns it."""

    def __init__(self) -> None:
        self._blocks: dict[str, _ReplicaBlocks] = {}
        self._holders: dict[int, int] = {}
        # Slot -> address; None marks a free slot (kept so that masks stay narrow).
        self._slots: list[str | None] = []
        self.figures = IndexFigures()

    # -- events ---------------------------------------------------------------

    def apply_stored(self, address: str, model: str, block_hashes: Iterable[int]) -> None:
        """``address`` now holds these blocks of ``model``.

        A replica serves one model; a stored event for another model while it
        still holds blocks means the follower missed a restart, which it must
        handle by ``forget_replica`` first. That mistake is ours, so it raises.
        """
        replica = self._blocks.get(address) or self._add_replica(address)
        if replica.model != model:
            if replica.hashes:
                raise ValueError(f"replica {address} holds blocks of {replica.model!r}, not {model!r}")
            replica.model = model
        hashes, holders, bit = replica.hashes, self._holders, replica.bit
        for block_hash in block_hashes:
            if block_hash not in hashes:
                hashes.add(block_hash)
                holders[block_hash] = holders.get(block_hash, 0) | bit

    def apply_removed(self, address: str, block_hashes: Iterable[int]) -> None:
        """``address`` no longer holds these blocks."""
        replica = self._blocks.get(address)
        if replica is None:
            return
        for block_hash in block_hashes:
            if block_hash in replica.hashes:
                replica.hashes.discard(block_hash)
                self._drop_holder(block_hash, replica.bit)

    def clear(self, address: str) -> None:
        """``address`` dropped every block but is still followed (and keeps its model)."""
        replica = self._blocks.get(address)
        if replica is None:
            return
        for block_hash in replica.hashes:
            self._drop_holder(block_hash, replica.bit)
        replica.hashes = set()

    def forget_replica(self, address: str) -> None:
        """Drop everything known about ``address`` (disconnected, restarted, or unwatched); frees its slot."""
        self.clear(address)
        replica = self._blocks.pop(address, None)
        if replica is not None:
            self._slots[replica.bit.bit_length() - 1] = None

    def _add_replica(self, address: str) -> _ReplicaBlocks:
        # The lowest free slot, so masks stay as narrow as the number of replicas.
        slot = next((i for i, held in enumerate(self._slots) if held is None), len(self._slots))
        if slot == len(self._slots):
            self._slots.append(address)
        else:
            self._slots[slot] = address
        replica = self._blocks[address] = _ReplicaBlocks(bit=1 << slot)
        return replica

    def _drop_holder(self, block_hash: int, bit: int) -> None:
        holders = self._holders[block_hash] & ~bit
        if holders:
            self._holders[block_hash] = holders
        else:
            # Keep _holders free of empty masks so its size is the number of distinct hashes.
            del self._holders[block_hash]

    # -- queries --------------------------------------------------------------

    def match(self, model: str, block_hashes: Sequence[int]) -> list[ReplicaMatch]:
        """Replicas of ``model`` holding at least block 0 of the chain, longest match first.

        Ties are ordered by address so that answers are deterministic.
        """
        self.figures.lookups += 1
        matches = self._walk(model, block_hashes)
        matches.sort(key=lambda m: (-m.matched_blocks, m.address))
        if matches:
            self.figures.hit_blocks += matches[0].matched_blocks
        return matches

    def _walk(self, model: str, block_hashes: Sequence[int]) -> list[ReplicaMatch]:
        if not block_hashes:
            return []
        holders = self._holders
        of_model = 0
        for replica in self._blocks.values():
            if replica.model == model:
                of_model |= replica.bit
        candidates = holders.get(block_hashes[0], 0) & of_model
        matches: list[ReplicaMatch] = []
        # Invariant at the top of iteration i: every candidate holds blocks 0..i-1.
        for i in range(1, len(block_hashes)):
            if not candidates:
                return matches
            still = candidates & holders.get(block_hashes[i], 0)
            if still != candidates:
                matches.extend(ReplicaMatch(address, i) for address in self._addresses(candidates & ~still))
                candidates = still
        matches.extend(ReplicaMatch(address, len(block_hashes)) for address in self._addresses(candidates))
        return matches

    def _addresses(self, mask: int) -> Iterator[str]:
        while mask:
            low = mask & -mask
            address = self._slots[low.bit_length() - 1]
            assert address is not None  # a freed slot's bit was cleared from every mask
            yield address
            mask ^= low

    def replica_blocks(self, address: str) -> int:
        """Blocks the index believes ``address`` holds (0 for an unknown replica)."""
        replica = self._blocks.get(address)
        return len(replica.hashes) if replica is not None else 0

    def replica_model(self, address: str) -> str:
        replica = self._blocks.get(address)
        return replica.model if replica is not None else ""

    def holds(self, address: str, block_hash: int) -> bool:
        replica = self._blocks.get(address)
        return replica is not None and bool(self._holders.get(block_hash, 0) & replica.bit)

    def replicas(self) -> list[str]:
        """Addresses with an entry (possibly holding no block), sorted."""
        return sorted(self._blocks)

    def total_blocks(self) -> int:
        """(replica, block) pairs held: a block cached on two replicas counts twice."""
        return sum(len(replica.hashes) for replica in self._blocks.values())

    def distinct_blocks(self) -> int:
        return len(self._holders)

    # -- checks ---------------------------------------------------------------

    def check_invariants(self) -> None:
        """Raise AssertionError unless ``_holders`` is exactly the inverse of ``_blocks`` and slots are consistent."""
        inverse: dict[int, int] = {}
        for address, replica in self._blocks.items():
            if self._slots[replica.bit.bit_length() - 1] != address or replica.bit & (replica.bit - 1):
                raise AssertionError(f"replica {address} does not own its slot")
            for block_hash in replica.hashes:
                inverse[block_hash] = inverse.get(block_hash, 0) | replica.bit
        if inverse != self._holders:
            raise AssertionError("holders map is not the inverse of the per-replica block sets")
        if sum(held is not None for held in self._slots) != len(self._blocks):
            raise AssertionError("a slot is held by an address the index does not follow")
        for address, replica in self._blocks.items():
            if replica.hashes and not replica.model:
                raise AssertionError(f"replica {address} holds blocks but has no model")
