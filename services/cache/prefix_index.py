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

Tiers: a replica holds blocks in its pool (``"engine"``), its host memory (``"host"``) and
the shared file tier (``"shared"``). Each tier is its own pair of maps, fed by the events that
name it. The shared tier is one folder that many replicas may see: an engine names its folder
(``KvEventBatch.shared_tier_id``: the folder's own id and the layout's key), and replicas that
name the same one form a *shared group*, which holds the union of what its members announced
(each announces the files it wrote, found or read, less those it removed or missed). A block
any member wrote is then credited to every member, which can load it; one any member removed
is gone for all. A replica that names no folder keeps its shared tier to itself, as it
announced it. A match is the engine's own lookup: the leading run in the pool, then
the run the host tier continues it with, then the run the shared tier continues that with;
each replica's answer says how many blocks came from each, since a hit in a lower tier
costs a copy (placement weighs them).

Hits are counted per replica (``IndexFigures.by_replica``): each lookup credits its longest
match, tier by tier, to that replica (the one placement would reuse most of the prompt on; load
may still send the request elsewhere, which only the router knows), and charges the chain's
length to every replica of the model, so a replica's hits over its queried blocks is its share
of the model's hit ratio (with one replica, the ratio itself).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Literal

# Where a replica holds a block, fastest first (as the engine's events name them).
Tier = Literal["engine", "host", "shared"]
TIERS: tuple[Tier, ...] = ("engine", "host", "shared")


@dataclass(frozen=True, order=True)
class ReplicaMatch:
    """How many leading blocks of a query one replica holds (at least one), by tier: the first
    ``engine_blocks`` in its pool, the next ``host_blocks`` in host memory, the next
    ``shared_blocks`` in the shared file tier."""

    address: str
    engine_blocks: int
    host_blocks: int = 0
    shared_blocks: int = 0

    @property
    def matched_blocks(self) -> int:
        return self.engine_blocks + self.host_blocks + self.shared_blocks


@dataclass
class _ReplicaBlocks:
    # This replica's bit in the ``_holders`` masks (1 << slot).
    bit: int
    # Model of the replica's blocks; "" until the first stored event names it.
    model: str = ""
    # Per tier, the hashes it holds there (its shared tier's: only while it is in no group).
    hashes: dict[Tier, set[int]] = field(default_factory=lambda: {tier: set() for tier in TIERS})
    # The shared folder it sees (a key of ``PrefixIndex._groups``); "": its own.
    shared_group: str = ""


@dataclass
class _SharedGroup:
    """Replicas that see one shared folder, and the blocks its files hold as they announced them."""

    # Mask of the members' bits.
    members: int = 0
    hashes: set[int] = field(default_factory=set)


@dataclass
class ReplicaHits:
    """What the lookups credited to one replica since start."""

    # Blocks asked by the lookups of its model while the index mirrored it (from its first stored
    # event until it was forgotten), each lookup's whole chain.
    queried_blocks: int = 0
    # Per tier, the blocks of the lookups where it was the longest match.
    hit_blocks: dict[Tier, int] = field(default_factory=lambda: dict.fromkeys(TIERS, 0))


@dataclass
class IndexFigures:
    """Counters since start; the metrics collector, ListReplicas and tests read these.

    ``by_replica`` keeps an address after the index forgets it (counters only grow), so it holds
    at most every replica ever followed: the metrics' replica label is bounded by the engines.
    """

    lookups: int = 0
    by_replica: dict[str, ReplicaHits] = field(default_factory=dict)

    def record(self, of_model: Iterable[str], queried_blocks: int, best: ReplicaMatch | None) -> None:
        """One lookup of ``queried_blocks`` blocks against the replicas ``of_model``."""
        self.lookups += 1
        for address in of_model:
            self.by_replica.setdefault(address, ReplicaHits()).queried_blocks += queried_blocks
        if best is not None:
            # The best match is of the model, so the loop above has its entry.
            hits = self.by_replica[best.address].hit_blocks
            hits["engine"] += best.engine_blocks
            hits["host"] += best.host_blocks
            hits["shared"] += best.shared_blocks

    def replica(self, address: str) -> ReplicaHits:
        """The counters of ``address`` (zeros for one never counted)."""
        return self.by_replica.get(address) or ReplicaHits()

    @property
    def hit_blocks_by_tier(self) -> dict[Tier, int]:
        """Sum over lookups of the longest match, by the tier each of its blocks came from."""
        return {tier: sum(hits.hit_blocks[tier] for hits in self.by_replica.values()) for tier in TIERS}

    @property
    def hit_blocks(self) -> int:
        """Sum over lookups of the longest match: blocks the best replica could reuse."""
        return sum(self.hit_blocks_by_tier.values())


class PrefixIndex:
    """The mirror of every replica's cached block hashes. Not thread-safe: one event loop owns it."""

    def __init__(self) -> None:
        self._blocks: dict[str, _ReplicaBlocks] = {}
        # Per tier: block hash -> mask of the replicas holding it there.
        self._holders: dict[Tier, dict[int, int]] = {tier: {} for tier in TIERS}
        # Slot -> address; None marks a free slot (kept so that masks stay narrow).
        self._slots: list[str | None] = []
        # Shared folder id -> the replicas that see it and what it holds.
        self._groups: dict[str, _SharedGroup] = {}
        self.figures = IndexFigures()

    # -- events ---------------------------------------------------------------

    def apply_stored(
        self, address: str, model: str, block_hashes: Iterable[int], tier: Tier = "engine"
    ) -> None:
        """``address`` now holds these blocks of ``model`` in ``tier``.

        A replica serves one model; a stored event for another model while it
        still holds blocks means the follower missed a restart, which it must
        handle by ``forget_replica`` first. That mistake is ours, so it raises.
        """
        replica = self._blocks.get(address) or self._add_replica(address)
        if replica.model != model:
            if any(replica.hashes.values()):
                raise ValueError(f"replica {address} holds blocks of {replica.model!r}, not {model!r}")
            replica.model = model
        hashes, holders, bit = replica.hashes[tier], self._holders[tier], replica.bit
        if tier == "shared" and replica.shared_group:
            group = self._groups[replica.shared_group]
            hashes, bit = group.hashes, group.members
        for block_hash in block_hashes:
            if block_hash not in hashes:
                hashes.add(block_hash)
                holders[block_hash] = holders.get(block_hash, 0) | bit

    def apply_removed(self, address: str, block_hashes: Iterable[int], tier: Tier = "engine") -> None:
        """``address`` no longer holds these blocks in ``tier``."""
        replica = self._blocks.get(address)
        if replica is None:
            return
        hashes, bit = replica.hashes[tier], replica.bit
        if tier == "shared" and replica.shared_group:
            group = self._groups[replica.shared_group]
            hashes, bit = group.hashes, group.members
        for block_hash in block_hashes:
            if block_hash in hashes:
                hashes.discard(block_hash)
                self._drop_holder(tier, block_hash, bit)

    def clear(self, address: str, tier: Tier | None = None) -> None:
        """``address`` dropped every block of ``tier`` (None: of every tier) but is still followed
        (and keeps its model)."""
        replica = self._blocks.get(address)
        if replica is None:
            return
        for cleared in TIERS if tier is None else (tier,):
            if cleared == "shared" and replica.shared_group:
                # The folder's files outlive what one replica says of them: it leaves the group
                # only when the index forgets it.
                if tier is None:
                    self._leave_group(replica)
                continue
            for block_hash in replica.hashes[cleared]:
                self._drop_holder(cleared, block_hash, replica.bit)
            replica.hashes[cleared] = set()

    def join_shared_group(self, address: str, model: str, group_id: str) -> None:
        """``address``, serving ``model``, sees the shared folder ``group_id`` (""): none, its
        shared tier is its own). It is credited with every block the folder's other replicas
        announced, before it announces any block itself, and they with what it announces."""
        replica = self._blocks.get(address) or self._add_replica(address)
        if replica.model != model and not any(replica.hashes.values()) and not replica.shared_group:
            replica.model = model
        if replica.shared_group == group_id:
            return
        if replica.shared_group:
            self._leave_group(replica)
        else:
            self.clear(address, "shared")
        if not group_id:
            return
        group = self._groups.setdefault(group_id, _SharedGroup())
        group.members |= replica.bit
        replica.shared_group = group_id
        holders = self._holders["shared"]
        for block_hash in group.hashes:
            holders[block_hash] = holders.get(block_hash, 0) | replica.bit

    def _leave_group(self, replica: _ReplicaBlocks) -> None:
        group_id, replica.shared_group = replica.shared_group, ""
        group = self._groups[group_id]
        for block_hash in group.hashes:
            self._drop_holder("shared", block_hash, replica.bit)
        group.members &= ~replica.bit
        if not group.members:
            # No replica left to announce or correct it: what it held is unknown now.
            del self._groups[group_id]

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

    def _drop_holder(self, tier: Tier, block_hash: int, bit: int) -> None:
        tier_holders = self._holders[tier]
        holders = tier_holders[block_hash] & ~bit
        if holders:
            tier_holders[block_hash] = holders
        else:
            # Keep the holders maps free of empty masks so their size is the number of distinct hashes.
            del tier_holders[block_hash]

    # -- queries --------------------------------------------------------------

    def match(self, model: str, block_hashes: Sequence[int]) -> list[ReplicaMatch]:
        """Replicas of ``model`` holding at least block 0 of the chain in some tier, longest match
        first.

        Ties are ordered by address so that answers are deterministic.
        """
        of_model = [address for address, replica in self._blocks.items() if replica.model == model]
        matches = self._walk(sum(self._blocks[address].bit for address in of_model), block_hashes)
        matches.sort(key=lambda m: (-m.matched_blocks, m.address))
        self.figures.record(of_model, len(block_hashes), matches[0] if matches else None)
        return matches

    def _walk(self, candidates: int, block_hashes: Sequence[int]) -> list[ReplicaMatch]:
        """One pass over the chain, starting from the replicas in the ``candidates`` mask, with
        three candidate masks: replicas still in their pool run, in their host run, and in their
        shared run. At each block a replica stays in its run, drops to a lower tier's run that
        holds the block, or is done."""
        if not block_hashes:
            return []
        engine_holders, host_holders, shared_holders = (self._holders[tier] for tier in TIERS)
        in_engine, in_host, in_shared = candidates, 0, 0
        # Per replica bit: the block index where its pool run ended, and where its host run ended.
        engine_end: dict[int, int] = {}
        host_end: dict[int, int] = {}
        matches: list[ReplicaMatch] = []
        # Invariant at the top of iteration i: every candidate holds blocks 0..i-1 in its runs.
        for i in range(len(block_hashes)):
            if not in_engine | in_host | in_shared:
                return matches
            block_hash = block_hashes[i]
            engine = engine_holders.get(block_hash, 0)
            host = host_holders.get(block_hash, 0) if host_holders else 0
            shared = shared_holders.get(block_hash, 0) if shared_holders else 0
            left_engine = in_engine & ~engine
            if left_engine:
                self._mark(left_engine, i, engine_end)
                in_engine &= engine
                in_host |= left_engine & host
                left_engine &= ~host
            left_host = (in_host & ~host) | left_engine
            if left_host:
                self._mark(left_host, i, host_end)
                in_host &= host
                in_shared |= left_host & shared
            done = (in_shared & ~shared) | (left_host & ~shared)
            if done:
                in_shared &= shared
                matches.extend(self._matches(done, i, engine_end, host_end))
        matches.extend(
            self._matches(in_engine | in_host | in_shared, len(block_hashes), engine_end, host_end)
        )
        return matches

    @staticmethod
    def _mark(mask: int, index: int, ends: dict[int, int]) -> None:
        while mask:
            low = mask & -mask
            ends.setdefault(low, index)
            mask ^= low

    def _matches(
        self, mask: int, end: int, engine_end: dict[int, int], host_end: dict[int, int]
    ) -> Iterator[ReplicaMatch]:
        """The matches of the replicas in ``mask``, whose runs ended at block ``end``."""
        while mask:
            low = mask & -mask
            mask ^= low
            if end == 0:
                continue
            address = self._slots[low.bit_length() - 1]
            assert address is not None  # a freed slot's bit was cleared from every mask
            engine = engine_end.get(low, end)
            host = host_end.get(low, end)
            yield ReplicaMatch(address, engine, host - engine, end - host)

    def _addresses(self, mask: int) -> Iterator[str]:
        while mask:
            low = mask & -mask
            address = self._slots[low.bit_length() - 1]
            assert address is not None  # a freed slot's bit was cleared from every mask
            yield address
            mask ^= low

    def replica_blocks(self, address: str, tier: Tier = "engine") -> int:
        """Blocks the index believes ``address`` holds in ``tier`` (0 for an unknown replica)."""
        replica = self._blocks.get(address)
        return len(self._hashes(replica, tier)) if replica is not None else 0

    def _hashes(self, replica: _ReplicaBlocks, tier: Tier) -> set[int]:
        """What ``replica`` holds in ``tier``: its group's, for a shared tier it shares."""
        if tier == "shared" and replica.shared_group:
            return self._groups[replica.shared_group].hashes
        return replica.hashes[tier]

    def shared_group(self, address: str) -> str:
        """The shared folder ``address`` sees, as it named it ("": its own, or unknown)."""
        replica = self._blocks.get(address)
        return replica.shared_group if replica is not None else ""

    def replica_model(self, address: str) -> str:
        replica = self._blocks.get(address)
        return replica.model if replica is not None else ""

    def holds(self, address: str, block_hash: int, tier: Tier = "engine") -> bool:
        replica = self._blocks.get(address)
        return replica is not None and bool(self._holders[tier].get(block_hash, 0) & replica.bit)

    def replicas(self) -> list[str]:
        """Addresses with an entry (possibly holding no block), sorted."""
        return sorted(self._blocks)

    def total_blocks(self, tier: Tier = "engine") -> int:
        """(replica, block) pairs held in ``tier``: a block cached on two replicas counts twice."""
        return sum(len(self._hashes(replica, tier)) for replica in self._blocks.values())

    def distinct_blocks(self, tier: Tier = "engine") -> int:
        return len(self._holders[tier])

    # -- checks ---------------------------------------------------------------

    def check_invariants(self) -> None:
        """Raise AssertionError unless ``_holders`` is exactly the inverse of ``_blocks`` and slots are consistent."""
        inverse: dict[Tier, dict[int, int]] = {tier: {} for tier in TIERS}
        for address, replica in self._blocks.items():
            if self._slots[replica.bit.bit_length() - 1] != address or replica.bit & (replica.bit - 1):
                raise AssertionError(f"replica {address} does not own its slot")
            for tier in TIERS:
                for block_hash in self._hashes(replica, tier):
                    inverse[tier][block_hash] = inverse[tier].get(block_hash, 0) | replica.bit
            if replica.shared_group and replica.hashes["shared"]:
                raise AssertionError(f"replica {address} keeps shared blocks of its own in a group")
        for tier in TIERS:
            if inverse[tier] != self._holders[tier]:
                raise AssertionError(f"{tier} holders map is not the inverse of the per-replica block sets")
        if sum(held is not None for held in self._slots) != len(self._blocks):
            raise AssertionError("a slot is held by an address the index does not follow")
        for address, replica in self._blocks.items():
            if any(replica.hashes.values()) and not replica.model:
                raise AssertionError(f"replica {address} holds blocks but has no model")
        for group_id, group in self._groups.items():
            members = sum(r.bit for r in self._blocks.values() if r.shared_group == group_id)
            if not group.members or members != group.members:
                raise AssertionError(f"shared group {group_id} does not list exactly its members")
