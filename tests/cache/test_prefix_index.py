"""The prefix index with exact expectations; invariants checked after every operation."""

from __future__ import annotations

import random
import time

import pytest

from cachet.block_hash import block_hashes
from cachet.cache.prefix_index import PrefixIndex, ReplicaMatch

MODEL = "tiny-llama"
A, B, C = "127.0.0.1:7001", "127.0.0.1:7002", "127.0.0.1:7003"
# A chain of 8 real block hashes (blocks of 16 tokens) so the tests use the same numbers an engine would.
CHAIN = block_hashes(list(range(8 * 16)), MODEL)


class CheckedIndex(PrefixIndex):
    """Runs the invariant checker after every mutation, so no test can forget to."""

    def apply_stored(self, address, model, hashes, tier="engine"):
        super().apply_stored(address, model, hashes, tier)
        self.check_invariants()

    def apply_removed(self, address, hashes, tier="engine"):
        super().apply_removed(address, hashes, tier)
        self.check_invariants()

    def clear(self, address, tier=None):
        super().clear(address, tier)
        self.check_invariants()

    def forget_replica(self, address):
        super().forget_replica(address)
        self.check_invariants()

    def join_shared_group(self, address, model, group_id):
        super().join_shared_group(address, model, group_id)
        self.check_invariants()


@pytest.fixture
def index() -> CheckedIndex:
    return CheckedIndex()


def test_empty_index_matches_nothing(index) -> None:
    assert index.match(MODEL, CHAIN) == []
    assert index.match(MODEL, []) == []
    assert index.total_blocks() == 0


def test_full_chain_matches_every_block(index) -> None:
    index.apply_stored(A, MODEL, CHAIN)
    assert index.match(MODEL, CHAIN) == [ReplicaMatch(A, 8)]
    assert index.replica_blocks(A) == 8
    assert index.total_blocks() == 8


def test_partial_chain_matches_its_leading_blocks(index) -> None:
    index.apply_stored(A, MODEL, CHAIN[:3])
    assert index.match(MODEL, CHAIN) == [ReplicaMatch(A, 3)]
    # A query shorter than what is held matches the whole query, not more.
    assert index.match(MODEL, CHAIN[:2]) == [ReplicaMatch(A, 2)]
    assert index.match(MODEL, CHAIN[:1]) == [ReplicaMatch(A, 1)]


def test_replica_without_block_zero_matches_nothing(index) -> None:
    # Holding blocks 1..7 without block 0 is worth nothing: KV of a suffix needs its prefix.
    index.apply_stored(A, MODEL, CHAIN[1:])
    assert index.match(MODEL, CHAIN) == []


def test_several_replicas_longest_first_ties_by_address(index) -> None:
    index.apply_stored(C, MODEL, CHAIN[:5])
    index.apply_stored(A, MODEL, CHAIN[:2])
    index.apply_stored(B, MODEL, CHAIN[:5])
    assert index.match(MODEL, CHAIN) == [ReplicaMatch(B, 5), ReplicaMatch(C, 5), ReplicaMatch(A, 2)]
    assert index.distinct_blocks() == 5
    assert index.total_blocks() == 12


def test_removal_in_the_middle_stops_the_match_there(index) -> None:
    index.apply_stored(A, MODEL, CHAIN)
    index.apply_stored(B, MODEL, CHAIN)
    index.apply_removed(A, [CHAIN[3]])
    assert index.match(MODEL, CHAIN) == [ReplicaMatch(B, 8), ReplicaMatch(A, 3)]
    # The blocks after the hole are still held (the engine has not evicted them) but unreachable.
    assert index.holds(A, CHAIN[4])
    assert index.replica_blocks(A) == 7
    index.apply_removed(A, [CHAIN[0]])
    assert index.match(MODEL, CHAIN) == [ReplicaMatch(B, 8)]


def test_restoring_the_hole_restores_the_match(index) -> None:
    index.apply_stored(A, MODEL, CHAIN)
    index.apply_removed(A, [CHAIN[3]])
    index.apply_stored(A, MODEL, [CHAIN[3]])
    assert index.match(MODEL, CHAIN) == [ReplicaMatch(A, 8)]


def test_branching_chains_share_their_common_prefix(index) -> None:
    other = block_hashes(list(range(3 * 16)) + [999] * 16 * 5, MODEL)
    assert other[:3] == CHAIN[:3] and other[3] != CHAIN[3]
    index.apply_stored(A, MODEL, CHAIN)
    index.apply_stored(B, MODEL, other)
    assert index.match(MODEL, CHAIN) == [ReplicaMatch(A, 8), ReplicaMatch(B, 3)]
    assert index.match(MODEL, other) == [ReplicaMatch(B, 8), ReplicaMatch(A, 3)]
    assert index.distinct_blocks() == 13


def test_stored_twice_and_unknown_removals_are_no_ops(index) -> None:
    index.apply_stored(A, MODEL, CHAIN[:4])
    index.apply_stored(A, MODEL, CHAIN[:4])
    assert index.replica_blocks(A) == 4
    index.apply_removed(A, [12345, CHAIN[6]])
    index.apply_removed(B, [CHAIN[0]])
    assert index.match(MODEL, CHAIN) == [ReplicaMatch(A, 4)]
    assert index.replicas() == [A]


def test_removing_every_block_keeps_the_replica_but_no_holders(index) -> None:
    index.apply_stored(A, MODEL, CHAIN[:2])
    index.apply_removed(A, CHAIN[:2])
    assert index.match(MODEL, CHAIN) == []
    assert index.distinct_blocks() == 0
    assert index.replicas() == [A]


def test_clear_drops_one_replicas_blocks_and_keeps_its_model(index) -> None:
    index.apply_stored(A, MODEL, CHAIN)
    index.apply_stored(B, MODEL, CHAIN[:6])
    index.clear(A)
    assert index.match(MODEL, CHAIN) == [ReplicaMatch(B, 6)]
    assert index.replica_blocks(A) == 0
    assert index.replica_model(A) == MODEL
    assert index.replicas() == [A, B]
    index.apply_stored(A, MODEL, CHAIN[:1])
    assert index.match(MODEL, CHAIN) == [ReplicaMatch(B, 6), ReplicaMatch(A, 1)]


def test_forget_replica_removes_it_entirely(index) -> None:
    index.apply_stored(A, MODEL, CHAIN)
    index.apply_stored(B, MODEL, CHAIN[:2])
    index.forget_replica(A)
    assert index.match(MODEL, CHAIN) == [ReplicaMatch(B, 2)]
    assert index.replicas() == [B]
    assert index.replica_model(A) == ""
    assert not index.holds(A, CHAIN[0])
    index.forget_replica(A)  # forgetting twice is harmless
    index.forget_replica(B)
    assert index.total_blocks() == 0 and index.distinct_blocks() == 0 and index.replicas() == []


def test_matches_only_replicas_of_the_asked_model(index) -> None:
    index.apply_stored(A, MODEL, CHAIN)
    # Another model's chain can never share hashes in practice; force it to, to show the filter.
    index.apply_stored(B, "other-model", CHAIN)
    assert index.match(MODEL, CHAIN) == [ReplicaMatch(A, 8)]
    assert index.match("other-model", CHAIN) == [ReplicaMatch(B, 8)]
    assert index.match("unknown", CHAIN) == []


def test_a_replica_changes_model_only_after_it_is_forgotten(index) -> None:
    index.apply_stored(A, MODEL, CHAIN[:1])
    with pytest.raises(ValueError, match="holds blocks of"):
        index.apply_stored(A, "other-model", CHAIN[1:2])
    index.check_invariants()
    index.forget_replica(A)
    index.apply_stored(A, "other-model", CHAIN[:2])
    assert index.match("other-model", CHAIN) == [ReplicaMatch(A, 2)]


def test_figures_count_lookups_and_best_match(index) -> None:
    index.apply_stored(A, MODEL, CHAIN[:3])
    index.apply_stored(B, MODEL, CHAIN[:5])
    index.match(MODEL, CHAIN)
    index.match(MODEL, CHAIN[:2])
    index.match(MODEL, [42])
    assert (index.figures.lookups, index.figures.hit_blocks) == (3, 5 + 2 + 0)


def test_invariant_checker_catches_a_broken_inverse(index) -> None:
    index.apply_stored(A, MODEL, CHAIN[:2])
    del index._holders["engine"][CHAIN[1]]  # A broken inverse, whatever the holders representation
    with pytest.raises(AssertionError, match="inverse"):
        index.check_invariants()


def test_randomised_operations_agree_with_a_naive_model() -> None:
    """Random stored/removed/clear/forget on 4 replicas, compared with a brute-force reference."""
    rng = random.Random(7)
    replicas = [A, B, C, "127.0.0.1:7004"]
    chains = [block_hashes([rng.randrange(50) for _ in range(16 * 12)], MODEL) for _ in range(3)]
    all_hashes = [h for chain in chains for h in chain]
    index = CheckedIndex()
    reference: dict[str, set[int]] = {}
    for _ in range(600):
        address, op = rng.choice(replicas), rng.random()
        if op < 0.45:
            chain = rng.choice(chains)
            start = rng.randrange(len(chain))
            stored = chain[start : start + rng.randrange(1, 6)]
            index.apply_stored(address, MODEL, stored)
            reference.setdefault(address, set()).update(stored)
        elif op < 0.85:
            removed = rng.sample(all_hashes, 3)
            index.apply_removed(address, removed)
            reference.get(address, set()).difference_update(removed)
        elif op < 0.93:
            index.clear(address)
            if address in reference:
                reference[address] = set()
        else:
            index.forget_replica(address)
            reference.pop(address, None)
        query = rng.choice(chains)[: rng.randrange(1, 13)]
        expected = []
        for name, held in reference.items():
            count = next((i for i, h in enumerate(query) if h not in held), len(query))
            if count:
                expected.append(ReplicaMatch(name, count))
        expected.sort(key=lambda m: (-m.matched_blocks, m.address))
        assert index.match(MODEL, query) == expected
        assert index.total_blocks() == sum(map(len, reference.values()))


def test_match_is_linear_on_a_10000_block_chain() -> None:
    rng = random.Random(2)
    chain = [rng.getrandbits(64) for _ in range(10_000)]
    index = PrefixIndex()
    for i in range(8):
        index.apply_stored(f"127.0.0.1:{8000 + i}", MODEL, chain[: 10_000 - i * 1000])
    index.check_invariants()

    started = time.perf_counter()
    matches = index.match(MODEL, chain)
    elapsed = time.perf_counter() - started

    assert [m.matched_blocks for m in matches] == [10_000 - i * 1000 for i in range(8)]
    # 10,000 blocks x 8 replicas is ~80k set operations: milliseconds. A quadratic walk
    # (re-scanning the prefix per block) would take seconds; the bound leaves room for a slow CI box.
    assert elapsed < 0.5, f"match took {elapsed:.3f} s"


def test_match_stops_early_when_no_replica_holds_block_zero() -> None:
    index = PrefixIndex()
    index.apply_stored(A, MODEL, [1, 2, 3])

    class CountingList(list):
        reads = 0

        def __getitem__(self, item):
            CountingList.reads += 1
            return super().__getitem__(item)

    query = CountingList([99, *range(100, 10_100)])
    assert index.match(MODEL, query) == []
    # Only block 0 was looked at: the walk stops as soon as no candidate is left.
    assert CountingList.reads == 1


# ---------------------------------------------------------------------------- tiers


def tiered(index: PrefixIndex, chain=CHAIN) -> list[tuple[str, int, int, int]]:
    return [(m.address, m.engine_blocks, m.host_blocks, m.shared_blocks) for m in index.match(MODEL, chain)]


def test_a_match_runs_through_the_pool_then_the_host_tier_then_the_shared_tier(index) -> None:
    index.apply_stored(A, MODEL, CHAIN[:2])
    index.apply_stored(A, MODEL, CHAIN[1:5], "host")
    index.apply_stored(A, MODEL, CHAIN[:7], "shared")
    # B holds the prefix only in its host tier, C only in the shared tier.
    index.apply_stored(B, MODEL, CHAIN[:3], "host")
    index.apply_stored(C, MODEL, CHAIN[:4], "shared")
    assert tiered(index) == [(A, 2, 3, 2), (C, 0, 0, 4), (B, 0, 3, 0)]
    assert [m.matched_blocks for m in index.match(MODEL, CHAIN)] == [7, 4, 3]


def test_a_lower_tier_run_ends_where_that_tier_has_a_hole(index) -> None:
    # A's host run starts after its pool run and stops at the host tier's hole at block 3, though
    # the pool holds block 3 again: the engine copies back only a run that continues.
    index.apply_stored(A, MODEL, [CHAIN[0], CHAIN[3]])
    index.apply_stored(A, MODEL, [CHAIN[1], CHAIN[2], CHAIN[4]], "host")
    assert tiered(index) == [(A, 1, 2, 0)]
    # A host run drops to the shared tier, and a shared run never climbs back.
    index.apply_stored(A, MODEL, [CHAIN[3], CHAIN[5]], "shared")
    assert tiered(index) == [(A, 1, 2, 1)]


def test_tiers_are_stored_removed_and_cleared_apart(index) -> None:
    index.apply_stored(A, MODEL, CHAIN[:4])
    index.apply_stored(A, MODEL, CHAIN[:4], "host")
    index.apply_removed(A, CHAIN[2:4])
    assert tiered(index) == [(A, 2, 2, 0)]
    assert [index.replica_blocks(A, t) for t in ("engine", "host", "shared")] == [2, 4, 0]
    assert index.total_blocks("host") == 4 and index.distinct_blocks("host") == 4
    index.clear(A, "engine")
    assert tiered(index) == [(A, 0, 4, 0)]
    index.clear(A)
    assert tiered(index) == []
    assert index.replica_model(A) == MODEL


def test_a_model_change_needs_every_tier_empty(index) -> None:
    index.apply_stored(A, MODEL, CHAIN[:1], "shared")
    with pytest.raises(ValueError, match="holds blocks"):
        index.apply_stored(A, "other", CHAIN[:1])


def test_figures_split_the_best_match_by_tier(index) -> None:
    index.apply_stored(A, MODEL, CHAIN[:1])
    index.apply_stored(A, MODEL, CHAIN[1:3], "host")
    index.apply_stored(B, MODEL, CHAIN[:2])
    index.match(MODEL, CHAIN)
    assert index.figures.hit_blocks == 3
    assert index.figures.hit_blocks_by_tier == {"engine": 1, "host": 2, "shared": 0}


def naive_matches(query: list[int], held: dict[str, list[set[int]]]) -> list[ReplicaMatch]:
    """The engine's own lookup rule, replica by replica: the leading run in its pool, then the run
    its host tier continues it with, then the shared tier's; ``held``: each replica's three sets."""
    expected = []
    for name, tiers in held.items():
        position, runs = 0, []
        for tier_held in tiers:
            start = position
            while position < len(query) and query[position] in tier_held:
                position += 1
            runs.append(position - start)
        if position:
            expected.append(ReplicaMatch(name, *runs))
    expected.sort(key=lambda m: (-m.matched_blocks, m.address))
    return expected


def test_randomised_tiered_operations_agree_with_a_naive_model() -> None:
    """Random per-tier stored/removed/clear on 3 replicas against the engine's own lookup rule."""
    rng = random.Random(11)
    replicas = [A, B, C]
    tiers = ("engine", "host", "shared")
    chains = [block_hashes([rng.randrange(40) for _ in range(16 * 10)], MODEL) for _ in range(2)]
    all_hashes = [h for chain in chains for h in chain]
    index = CheckedIndex()
    reference = {(r, t): set() for r in replicas for t in tiers}
    for _ in range(800):
        address, tier, op = rng.choice(replicas), rng.choice(tiers), rng.random()
        if op < 0.5:
            chain = rng.choice(chains)
            start = rng.randrange(len(chain))
            stored = chain[start : start + rng.randrange(1, 6)]
            index.apply_stored(address, MODEL, stored, tier)
            reference[address, tier].update(stored)
        elif op < 0.95:
            removed = rng.sample(all_hashes, 3)
            index.apply_removed(address, removed, tier)
            reference[address, tier].difference_update(removed)
        else:
            index.clear(address, tier)
            reference[address, tier] = set()
        query = rng.choice(chains)[: rng.randrange(1, 11)]
        held = {name: [reference[name, tier_name] for tier_name in tiers] for name in replicas}
        assert index.match(MODEL, query) == naive_matches(query, held)


def test_hits_are_counted_per_replica_and_tier_and_queries_per_replica_of_the_model(index) -> None:
    """Each lookup credits its longest match, tier by tier, to that replica alone, and charges the
    chain's length to every replica of the model; the per-replica counts add up to the totals."""
    # A: block 0 in its pool, 1-2 in host memory, 3 in the shared tier (4 blocks).
    index.apply_stored(A, MODEL, CHAIN[:1])
    index.apply_stored(A, MODEL, CHAIN[1:3], "host")
    index.apply_stored(A, MODEL, CHAIN[3:4], "shared")
    # B: blocks 0-5 in its pool (6 blocks). C serves another model.
    index.apply_stored(B, MODEL, CHAIN[:6])
    index.apply_stored(C, "other-model", CHAIN[:8])
    index.match(MODEL, CHAIN)  # B: 6 pool blocks
    index.match(MODEL, CHAIN[:4])  # A and B hold all 4; the tie goes to A: 1 + 2 + 1
    index.match(MODEL, [42, *CHAIN[1:3]])  # no one holds block 0
    index.apply_stored(A, MODEL, CHAIN[:1], "host")  # A's host tier takes block 0 too
    index.apply_removed(B, CHAIN[:6])
    index.match(MODEL, CHAIN[:2])  # A alone: pool 1, host 1
    assert index.figures.lookups == 4
    hits = {address: dict(counted.hit_blocks) for address, counted in index.figures.by_replica.items()}
    assert hits == {
        A: {"engine": 1 + 1, "host": 2 + 1, "shared": 1},
        B: {"engine": 6, "host": 0, "shared": 0},
    }
    queried = {address: counted.queried_blocks for address, counted in index.figures.by_replica.items()}
    assert queried == {A: 8 + 4 + 3 + 2, B: 8 + 4 + 3 + 2}
    assert index.figures.hit_blocks_by_tier == {"engine": 8, "host": 3, "shared": 1}
    assert index.figures.hit_blocks == 12
    # B, empty, was still charged above; forgotten, it is not, and keeps its counts. One never
    # counted reads as zeros.
    index.forget_replica(B)
    index.match(MODEL, CHAIN[:2])  # A again: pool 1, host 1; B is no longer charged
    assert index.figures.replica(B).hit_blocks["engine"] == 6
    assert index.figures.replica(B).queried_blocks == 17
    assert index.figures.replica(A).queried_blocks == 19
    assert index.figures.replica(C).queried_blocks == 0 and C not in index.figures.by_replica


# ------------------------------------------------------------- one shared folder, many replicas


def test_replicas_that_see_one_shared_folder_are_credited_with_what_any_of_them_wrote(index) -> None:
    index.join_shared_group(A, MODEL, "folder-1/layout")
    index.apply_stored(A, MODEL, CHAIN[:4], "shared")
    # B sees the same folder: A's files are B's to load too, before B ever read one.
    index.join_shared_group(B, MODEL, "folder-1/layout")
    # C sees another folder (or the same one under another layout): nothing of A's.
    index.join_shared_group(C, MODEL, "folder-2/layout")
    index.apply_stored(C, MODEL, CHAIN[:1])
    assert tiered(index) == [(A, 0, 0, 4), (B, 0, 0, 4), (C, 1, 0, 0)]
    assert index.replica_blocks(B, "shared") == 4 and index.shared_group(B) == "folder-1/layout"
    # What B writes is A's too; a file B's clean-up removed is gone for A as well.
    index.apply_stored(B, MODEL, CHAIN[4:6], "shared")
    index.apply_removed(B, CHAIN[2:3], "shared")
    assert tiered(index) == [(A, 0, 0, 2), (B, 0, 0, 2), (C, 1, 0, 0)]
    assert tiered(index, CHAIN[3:]) == [(A, 0, 0, 3), (B, 0, 0, 3)]
    # A replica's own reset leaves the folder's files (and the group) alone.
    index.clear(A, "shared")
    assert tiered(index, CHAIN[3:]) == [(A, 0, 0, 3), (B, 0, 0, 3)]


def test_a_forgotten_member_leaves_its_group_and_the_last_one_takes_the_group_with_it(index) -> None:
    index.join_shared_group(A, MODEL, "folder")
    index.join_shared_group(B, MODEL, "folder")
    index.apply_stored(A, MODEL, CHAIN[:3], "shared")
    index.forget_replica(A)
    assert tiered(index) == [(B, 0, 0, 3)]
    index.forget_replica(B)
    assert tiered(index) == []
    # A new subscription starts from what its snapshot says, not from a group nobody vouches for.
    index.join_shared_group(A, MODEL, "folder")
    assert tiered(index) == []


def test_a_replica_that_names_no_folder_keeps_its_shared_tier_to_itself(index) -> None:
    index.apply_stored(A, MODEL, CHAIN[:2], "shared")
    index.join_shared_group(B, MODEL, "folder")
    index.apply_stored(B, MODEL, CHAIN[:3], "shared")
    assert tiered(index) == [(B, 0, 0, 3), (A, 0, 0, 2)]
    # Joining drops what it announced on its own (the snapshot that follows says it again).
    index.join_shared_group(A, MODEL, "folder")
    assert tiered(index) == [(A, 0, 0, 3), (B, 0, 0, 3)]
    index.join_shared_group(A, MODEL, "")
    assert tiered(index) == [(B, 0, 0, 3)]


def test_randomised_shared_groups_agree_with_a_naive_model() -> None:
    """Stored/removed/clear on 3 replicas, two of them sometimes in one group: a group member's
    shared run reads the union of what the members announced, less what any removed."""
    rng = random.Random(5)
    replicas = [A, B, C]
    chains = [block_hashes([rng.randrange(40) for _ in range(16 * 10)], MODEL) for _ in range(2)]
    all_hashes = [h for chain in chains for h in chain]
    index = CheckedIndex()
    own = {r: set() for r in replicas}
    groups: dict[str, set[int]] = {}
    member = {r: "" for r in replicas}
    pool = {r: set() for r in replicas}
    for _ in range(600):
        address, op = rng.choice(replicas), rng.random()
        held = groups[member[address]] if member[address] else own[address]
        if op < 0.1:
            group_id = rng.choice(["", "g1", "g2"])
            index.join_shared_group(address, MODEL, group_id)
            if member[address] != group_id:
                if member[address] and not any(
                    member[r] == member[address] for r in replicas if r != address
                ):
                    del groups[member[address]]
                own[address] = set()
                member[address] = group_id
                if group_id:
                    groups.setdefault(group_id, set())
        elif op < 0.5:
            chain = rng.choice(chains)
            start = rng.randrange(len(chain))
            stored = chain[start : start + rng.randrange(1, 6)]
            index.apply_stored(address, MODEL, stored, "shared")
            held.update(stored)
        elif op < 0.8:
            removed = rng.sample(all_hashes, 3)
            index.apply_removed(address, removed, "shared")
            held.difference_update(removed)
        else:
            chain = rng.choice(chains)
            index.apply_stored(address, MODEL, chain[:3])
            pool[address].update(chain[:3])
        query = rng.choice(chains)[: rng.randrange(1, 11)]
        held = {
            name: [pool[name], set(), groups[member[name]] if member[name] else own[name]]
            for name in replicas
        }
        assert index.match(MODEL, query) == naive_matches(query, held)
