"""KV events name their tier: a pool eviction the host tier keeps is engine-removed and
host-stored, a host eviction is host-removed, a shared-tier file is shared-stored; exact
hashes, in order, and a follower that replays them holds each tier's exact set."""

from __future__ import annotations

import random
from pathlib import Path

import torch
from test_block_pool import replay
from test_host_kv_tier import PROMPT_A, PROMPT_B, make_kv, run_whole
from test_kv_cache_manager import BS, MODEL, admit, make_request
from test_shared_kv_tier import block, files

from cachet.block_hash import block_hashes
from cachet.engine.block_pool import (
    KV_TIERS,
    AllBlocksCleared,
    BlockPool,
    BlocksRemoved,
    BlocksStored,
    KvEvent,
)
from cachet.engine.host_kv_tier import HostTierIndex
from cachet.engine.kv_cache_manager import KVCacheManager

A = block_hashes(PROMPT_A, MODEL, block_size=BS)
B = block_hashes(PROMPT_B, MODEL, block_size=BS)


def stored(tier: str, *hashes: int) -> BlocksStored:
    return BlocksStored(hashes, None, tier)  # type: ignore[arg-type]


def removed(tier: str, *hashes: int) -> BlocksRemoved:
    return BlocksRemoved(hashes, tier)  # type: ignore[arg-type]


def mirror(events: list[KvEvent], known: dict[str, set[int]]) -> None:
    """What the cache index does: each tier's events applied to that tier's set alone."""
    for tier in KV_TIERS:
        replay([e for e in events if e.tier == tier], known[tier])


def test_demote_promote_and_evict_name_their_tiers_with_exact_hashes():
    assert len(A) == len(B) == 3
    kv = make_kv(num_blocks=4, host_slots=8)
    run_whole(kv, make_request("a", PROMPT_A))
    assert kv.take_events() == [stored("engine", *A)]
    # b evicts a's blocks from the pool, tail first; the host tier keeps every one of them.
    run_whole(kv, make_request("b", PROMPT_B))
    assert kv.take_events() == [
        removed("engine", A[2], A[1], A[0]),
        stored("engine", *B),
        stored("host", A[2], A[1], A[0]),
    ]
    # a again, from the host tier: b's blocks go down (the host copies of a stay: the tier is
    # inclusive), and a's promoted blocks are named in the pool once computed.
    _, hit_tokens = run_whole(kv, make_request("a2", PROMPT_A))
    assert hit_tokens == 12
    assert kv.take_events() == [
        removed("engine", B[2], B[1], B[0]),
        stored("engine", *A),
        stored("host", B[2], B[1], B[0]),
    ]
    assert kv.take_events() == []
    # A reset drops both tiers.
    kv.take_block_moves()
    assert kv.reset_prefix_cache()
    assert kv.take_events() == [AllBlocksCleared("engine"), AllBlocksCleared("host")]


def test_a_full_host_tier_reports_what_it_evicts_before_what_it_gains():
    tier = HostTierIndex(2)
    tier.demote([(0, 111), (1, 222)])
    tier.demote([(5, 111)])  # already held: refreshed, nothing new for the index
    tier.demote([(2, 333)])
    assert tier.take_events() == [stored("host", 111, 222), removed("host", 222), stored("host", 333)]
    # One slot: a hash evicted and one stored alternate, and their order is kept.
    one = HostTierIndex(1)
    one.demote([(0, 1), (1, 2)])
    assert one.take_events() == [stored("host", 1), removed("host", 1), stored("host", 2)]
    one.take_moves()
    one.fill([(3, torch.zeros(1))])
    assert one.take_events() == [removed("host", 2), stored("host", 3)]
    assert one.snapshot_events() == [stored("host", 3)]


def test_a_host_tier_without_a_follower_keeps_no_events_and_the_same_slots():
    """What ``cachet replay`` builds: the index sees only the pools, so its host tiers keep no
    events; they hold, evict and order copies exactly as one that does."""
    rng = random.Random(3)
    quiet, loud = HostTierIndex(4, events=False), HostTierIndex(4)
    for block_id in range(40):
        evicted = [
            (block_id, rng.randrange(9), *([float(rng.randrange(1, 4))] if rng.random() < 0.5 else []))
        ]
        quiet.demote(evicted)
        loud.demote(evicted)
        assert quiet.take_moves() == loud.take_moves()
        assert quiet.eviction_order() == loud.eviction_order()
        quiet.end_retention(block_id / 10)
        loud.end_retention(block_id / 10)
    assert loud.take_events() and quiet.take_events() == []
    quiet.clear()
    assert quiet.take_events() == []


def test_a_follower_of_random_traffic_holds_each_tiers_exact_set():
    rng = random.Random(7)
    kv = make_kv(num_blocks=12, host_slots=10)
    known: dict[str, set[int]] = {tier: set() for tier in KV_TIERS}
    prompts = [[rng.randrange(50) for _ in range(rng.randrange(2, 14))] for _ in range(12)]
    for i in range(300):
        request = make_request(f"r{i}", prompts[rng.randrange(len(prompts))])
        admit(kv, request)
        kv.free(request)
        kv.take_block_moves()
        mirror(kv.take_events(), known)
        if i == 150:
            # A follower arriving now starts from the snapshot and ends equal too.
            late = {tier: set() for tier in KV_TIERS}
            mirror(kv.snapshot_events(), late)
        if i > 150:
            mirror(kv.take_events(), late)
        expected = {tier: set() for tier in KV_TIERS}
        mirror(kv.snapshot_events(), expected)
        assert known == expected
        assert known["engine"] == kv.cached_block_hashes()
        assert len(known["host"]) == kv.num_host_blocks[0]
    assert known["host"] - known["engine"], "the traffic never left a block only in the host tier"


def test_shared_files_are_announced_when_written_found_read_or_removed(tmp_path: Path) -> None:
    tier = files(tmp_path)
    tier.write_later(123, block(1))
    tier.write_later(124, block(2))
    tier.drain()
    assert tier.take_events() == [stored("shared", 123, 124)]
    # Another replica sharing the folder wrote 125: this one announces it once it reads it.
    other = files(tmp_path)
    other.write_later(125, block(3))
    other.drain()
    assert tier.take_events() == []
    assert tier.read(125) is not None
    assert tier.take_events() == [stored("shared", 125)]
    # Gone under this replica (another's clean-up): its miss withdraws it.
    tier.path(124).unlink()
    assert tier.read(124) is None
    # A damaged file is refused, removed and withdrawn.
    tier.path(123).write_bytes(b"torn")
    assert tier.read(123) is None
    assert tier.take_events() == [removed("shared", 124, 123)]
    assert tier.snapshot_events() == [stored("shared", 125)]


def test_the_shared_folders_clean_up_withdraws_the_files_it_removes(tmp_path: Path) -> None:
    probe = files(tmp_path)
    probe.write_later(0, block(0))
    probe.drain()
    file_size = probe.path(0).stat().st_size
    probe.path(0).unlink()
    tier = files(tmp_path, budget=int(2.5 * file_size))
    for h in (10, 11, 12):
        tier.write_later(h, block(h))
        tier.drain()
    sizes = [tier.path(h).stat().st_size for h in (10, 11, 12)]
    tier.clean_up()
    events = tier.take_events()
    assert events[0] == stored("shared", 10, 11, 12)
    assert len(events) == 2 and isinstance(events[1], BlocksRemoved) and events[1].tier == "shared"
    gone = set(events[1].block_hashes)
    assert len(gone) == 1 and all(tier.contains(h) != (h in gone) for h in (10, 11, 12))
    assert tier.bytes["written"] == sum(sizes)


def test_a_managers_snapshot_and_events_cover_the_shared_tier(tmp_path: Path) -> None:
    shared = files(tmp_path)
    kv = KVCacheManager(
        BlockPool(4), model=MODEL, block_size=BS, host_tier=HostTierIndex(4), shared_tier=shared
    )
    shared.write_later(A[0], block(0))
    shared.drain()
    assert kv.take_events() == [stored("shared", A[0])]
    assert kv.snapshot_events() == [stored("shared", A[0])]
    run_whole(kv, make_request("a", PROMPT_A))
    assert kv.take_events() == [stored("engine", *A)]
    assert kv.snapshot_events() == [stored("engine", *sorted(A)), stored("shared", A[0])]
