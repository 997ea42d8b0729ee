"""Block pool: exact block ids, eviction order, events, and the invariant checker."""

from __future__ import annotations

import random

import pytest

from cachet.engine.block_pool import (
    AllBlocksCleared,
    BlockPool,
    BlocksRemoved,
    BlocksStored,
    KvEvent,
    NoFreeBlocks,
)


def checked(pool: BlockPool) -> BlockPool:
    pool.check_invariants()
    return pool


def replay(events: list[KvEvent], known: set[int]) -> None:
    """Apply events to a follower's set of hashes, as the cache service would."""
    for event in events:
        if isinstance(event, BlocksStored):
            assert known.isdisjoint(event.block_hashes), "stored a hash that was already known"
            known.update(event.block_hashes)
        elif isinstance(event, BlocksRemoved):
            assert set(event.block_hashes) <= known, "removed a hash that was never stored"
            known.difference_update(event.block_hashes)
        else:
            assert isinstance(event, AllBlocksCleared)
            known.clear()


def test_allocate_takes_lowest_ids_first_and_free_returns_them():
    pool = checked(BlockPool(4))
    assert pool.allocate(2) == [0, 1]
    checked(pool)
    assert pool.num_free_blocks == 2
    assert [pool.ref_count(b) for b in range(4)] == [1, 1, 0, 0]
    pool.free([1, 0])
    checked(pool)
    # Unnamed blocks go to the head: reused first, most recently freed first.
    assert pool.free_block_ids() == [0, 1, 2, 3]
    assert pool.take_events() == []


def test_allocate_more_than_free_raises():
    pool = BlockPool(2)
    pool.allocate(2)
    with pytest.raises(NoFreeBlocks):
        pool.allocate(1)
    checked(pool)


def test_cached_blocks_stay_findable_when_free_and_are_evicted_lru_first():
    pool = BlockPool(4)
    blocks = pool.allocate(3)
    pool.cache_blocks(blocks, [100, 101, 102], None)
    assert pool.take_events() == [BlocksStored((100, 101, 102), None)]
    # Freed tail first, as the KV cache manager does.
    pool.free(reversed(blocks))
    checked(pool)
    assert pool.free_block_ids() == [3, 2, 1, 0]
    assert pool.lookup(101) == 1
    # The unnamed block 3 goes first, then the sequence's tail (102, block 2).
    assert pool.allocate(2) == [3, 2]
    checked(pool)
    assert pool.take_events() == [BlocksRemoved((102,))]
    assert pool.lookup(102) is None
    assert pool.lookup(100) == 0


def test_touch_revives_a_free_cached_block():
    pool = BlockPool(3)
    [block] = pool.allocate(1)
    pool.cache_blocks([block], [7], None)
    pool.free([block])
    pool.touch([block])
    checked(pool)
    assert pool.ref_count(block) == 1
    assert block not in pool.free_block_ids()
    pool.touch([block])
    assert pool.ref_count(block) == 2
    pool.free([block])
    assert pool.ref_count(block) == 1 and pool.num_free_blocks == 2
    checked(pool)


def test_duplicate_hash_is_not_registered_twice():
    pool = BlockPool(4)
    first = pool.allocate(2)
    pool.cache_blocks(first, [1, 2], None)
    second = pool.allocate(2)
    # Same prefix computed by another request at the same time: block of hash 1 is
    # already held elsewhere, so only the new hash 3 is stored, chained to 1.
    pool.cache_blocks(second, [1, 3], None)
    checked(pool)
    assert pool.lookup(1) == first[0]
    assert pool.block_hash(second[0]) is None
    assert pool.take_events() == [BlocksStored((1, 2), None), BlocksStored((3,), 1)]


def test_free_of_unheld_block_raises():
    pool = BlockPool(2)
    with pytest.raises(AssertionError, match="ref count 0"):
        pool.free([0])


def test_reset_only_when_idle():
    pool = BlockPool(2)
    blocks = pool.allocate(2)
    pool.cache_blocks(blocks, [5, 6], None)
    assert not pool.reset()
    pool.free(blocks)
    assert pool.reset()
    checked(pool)
    assert pool.cached_hashes() == set()
    assert pool.take_events() == [BlocksStored((5, 6), None), AllBlocksCleared()]


def test_caching_disabled_names_nothing():
    pool = BlockPool(2, enable_caching=False)
    blocks = pool.allocate(2)
    pool.cache_blocks(blocks, [5, 6], None)
    assert pool.cached_hashes() == set() and pool.take_events() == []
    checked(pool)


@pytest.mark.parametrize(
    ("corrupt", "message"),
    [
        (lambda p: p._ref_counts.__setitem__(0, -1), "negative ref counts"),
        (lambda p: p._ref_counts.__setitem__(1, 1), "free list"),
        (lambda p: p._free.pop(2), "free list"),
        (lambda p: p._by_hash.__setitem__(99, 0), "hash map"),
        (lambda p: p._hashes.__setitem__(3, 42), "carry a hash"),
    ],
)
def test_invariant_checker_catches_corruption(corrupt, message):
    pool = BlockPool(4)
    corrupt(pool)
    with pytest.raises(AssertionError, match=message):
        pool.check_invariants()


def test_random_operations_keep_invariants_and_events_mirror_the_cache():
    rng = random.Random(1234)
    pool = BlockPool(16)
    held: list[int] = []  # one entry per reference held
    known: set[int] = set()
    next_hash = 1
    for _ in range(3000):
        op = rng.random()
        if op < 0.35 and pool.num_free_blocks:
            held += pool.allocate(rng.randint(1, min(3, pool.num_free_blocks)))
        elif op < 0.55 and held:
            unnamed = [b for b in set(held) if pool.block_hash(b) is None]
            if unnamed:
                chosen = rng.sample(unnamed, rng.randint(1, len(unnamed)))
                hashes = [rng.choice([next_hash, rng.randint(1, max(1, next_hash))]) for _ in chosen]
                hashes = list(dict.fromkeys(hashes))[: len(chosen)]
                chosen = chosen[: len(hashes)]
                next_hash += 1
                pool.cache_blocks(chosen, hashes, None)
        elif op < 0.7 and pool.cached_hashes():
            block = pool.lookup(rng.choice(sorted(pool.cached_hashes())))
            pool.touch([block])
            held.append(block)
        elif held:
            block = held.pop(rng.randrange(len(held)))
            pool.free([block])
        pool.check_invariants()
        replay(pool.take_events(), known)
        assert known == pool.cached_hashes()
    pool.free(held)
    pool.check_invariants()
    assert pool.num_free_blocks == 16
