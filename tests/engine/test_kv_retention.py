"""KV retention: retained blocks leave each tier last, earliest retention end first; the pool's
plain LRU order is untouched without retention. Exact block ids and slots; invariant checkers
after every operation."""

from __future__ import annotations

import random

import pytest
from test_block_pool import checked, replay

from cachet.engine.block_pool import BlockPool, BlocksRemoved, EvictedBlock
from cachet.engine.host_kv_tier import HostTierIndex
from cachet.engine.kv_retention import RetainedKeys

# ---------------------------------------------------------------- RetainedKeys


def test_retained_keys_go_earliest_deadline_first_then_in_the_order_they_became_evictable():
    keys = RetainedKeys()
    for key, until in [(1, 50.0), (2, 20.0), (3, 50.0), (4, 20.0)]:
        keys.retain(key, until)
    for key in (3, 1, 4, 2):
        keys.park(key)
    keys.check_invariants()
    assert keys.eviction_order() == [4, 2, 3, 1]
    # A retention only grows, and a longer one re-queues the key behind the equal deadlines.
    keys.retain(4, 10.0)
    keys.retain(4, 50.0)
    assert keys.eviction_order() == [2, 3, 1, 4]
    # One that ends after the caller's own deadline is not taken.
    assert keys.pop(until_at_most=10.0) is None
    assert keys.pop(skip=lambda key: key == 2) == (3, 50.0)
    assert keys.eviction_order() == [2, 1, 4]
    keys.unpark(1)
    assert keys.expire(50.0) == [2, 4]  # 1 is in use: its retention ends, it was not evictable
    assert len(keys) == 0 and keys.num_evictable == 0
    keys.check_invariants()


# ---------------------------------------------------------------- the block pool


def two_sequences(pool: BlockPool, *, retain_a: float | None) -> None:
    """a = blocks 0, 1, 2 (hashes 10, 11, 12), then b = blocks 3, 4 (20, 21); a ends first."""
    a = pool.allocate(3)
    pool.cache_blocks(a, [10, 11, 12], None)
    b = pool.allocate(2)
    pool.cache_blocks(b, [20, 21], None)
    if retain_a is not None:
        pool.retain(reversed(a), retain_a)
    pool.free(reversed(a))
    checked(pool)
    pool.free(reversed(b))
    checked(pool)


def test_without_retention_the_pool_evicts_in_plain_lru_order():
    pool = BlockPool(6)
    two_sequences(pool, retain_a=None)
    # The unused block 5, then a's tail first, then b's.
    assert pool.free_block_ids() == [5, 2, 1, 0, 4, 3]
    pool.end_retention(1e12)  # nothing is retained: nothing moves
    assert pool.free_block_ids() == [5, 2, 1, 0, 4, 3]
    assert pool.allocate(4) == [5, 2, 1, 0]
    assert pool.take_evicted() == [EvictedBlock(2, 12), EvictedBlock(1, 11), EvictedBlock(0, 10)]
    checked(pool)


def test_retained_free_blocks_are_evicted_after_every_unretained_one():
    pool = BlockPool(6)
    two_sequences(pool, retain_a=100.0)
    assert pool.num_free_blocks == 6 and pool.num_retained_blocks == 3
    # a ended first, yet b's blocks go before it: a is retained (its tail first among equals).
    assert pool.free_block_ids() == [5, 4, 3, 2, 1, 0]
    assert pool.allocate(4) == [5, 4, 3, 2]
    checked(pool)
    assert pool.take_evicted() == [EvictedBlock(4, 21), EvictedBlock(3, 20), EvictedBlock(2, 12, 100.0)]
    events = pool.take_events()
    assert events[-1] == BlocksRemoved((21, 20, 12))
    assert pool.lookup(11) == 1 and pool.retained_until(1) == 100.0
    assert pool.retained_until(2) is None


def test_retained_blocks_go_earliest_retention_end_first():
    pool = BlockPool(6)
    for first, hashes, until in [(0, [10, 11], 300.0), (2, [20, 21], 100.0), (4, [30, 31], 200.0)]:
        blocks = pool.allocate(2)
        assert blocks == [first, first + 1]
        pool.cache_blocks(blocks, hashes, None)
        pool.retain(reversed(blocks), until)
        pool.free(reversed(blocks))
        checked(pool)
    assert pool.free_block_ids() == [3, 2, 5, 4, 1, 0]
    assert pool.allocate(3) == [3, 2, 5]
    assert [e.retained_until for e in pool.take_evicted()] == [100.0, 100.0, 200.0]
    checked(pool)


def test_a_retention_that_ends_leaves_its_blocks_as_if_freed_then():
    pool = BlockPool(6)
    two_sequences(pool, retain_a=100.0)
    pool.end_retention(99.9)
    assert pool.num_retained_blocks == 3
    pool.end_retention(100.0)
    checked(pool)
    # After b's blocks (freed before 100), before anything freed from now on.
    assert pool.num_retained_blocks == 0 and pool.retained_until(2) is None
    assert pool.free_block_ids() == [5, 4, 3, 2, 1, 0]
    [block] = pool.allocate(1)
    pool.cache_blocks([block], [50], None)
    pool.free([block])
    assert pool.free_block_ids() == [4, 3, 2, 1, 0, 5]
    assert pool.allocate(4) == [4, 3, 2, 1]
    assert pool.take_evicted() == [
        EvictedBlock(4, 21),
        EvictedBlock(3, 20),
        EvictedBlock(2, 12),
        EvictedBlock(1, 11),
    ]
    checked(pool)


def test_a_hit_on_a_retained_block_keeps_its_retention_and_a_later_retain_extends_it():
    pool = BlockPool(4)
    two = pool.allocate(2)
    pool.cache_blocks(two, [10, 11], None)
    pool.retain(reversed(two), 100.0)
    pool.free(reversed(two))
    # Another request hits the prefix: in use, not evictable, still retained.
    pool.touch([0])
    checked(pool)
    assert pool.free_block_ids() == [2, 3, 1]
    assert pool.retained_until(0) == 100.0
    # It ends with a longer retention: now block 1 (100) goes before block 0 (250).
    pool.retain([0], 250.0)
    pool.free([0])
    checked(pool)
    assert pool.free_block_ids() == [2, 3, 1, 0]
    # Retaining a free unretained block takes it off the free list.
    [fresh] = pool.allocate(1)
    pool.cache_blocks([fresh], [40], None)
    pool.free([fresh])
    assert pool.free_block_ids() == [3, 2, 1, 0]
    pool.retain([2], 50.0)
    checked(pool)
    assert pool.free_block_ids() == [3, 2, 1, 0] and pool.retained_until(2) == 50.0
    with pytest.raises(AssertionError, match="without a hash"):
        pool.retain([3], 10.0)


def test_a_reset_forgets_retention_with_the_hashes():
    pool = BlockPool(4)
    blocks = pool.allocate(2)
    pool.cache_blocks(blocks, [10, 11], None)
    pool.retain(blocks, 100.0)
    assert not pool.reset()
    pool.free(reversed(blocks))
    assert pool.reset()
    checked(pool)
    assert pool.num_retained_blocks == 0 and pool.num_free_blocks == 4
    assert pool.free_block_ids() == [2, 3, 1, 0]


@pytest.mark.parametrize(
    ("corrupt", "message"),
    [
        (lambda p: p._free.__setitem__(1, None), "free list"),
        (lambda p: p._retained.forget(0), "free list"),
        (lambda p: p._hashes.__setitem__(1, None), "carry no hash"),
        (lambda p: p._retained._queue.clear(), "eviction queue"),
    ],
)
def test_the_invariant_checker_catches_broken_retention(corrupt, message):
    pool = BlockPool(3)
    blocks = pool.allocate(2)
    pool.cache_blocks(blocks, [10, 11], None)
    pool.retain(blocks, 100.0)
    pool.free(blocks)
    checked(pool)
    corrupt(pool)
    with pytest.raises(AssertionError, match=message):
        pool.check_invariants()


def test_random_operations_with_retention_keep_invariants_and_events_mirror_the_cache():
    rng = random.Random(4321)
    pool = BlockPool(12)
    held: list[int] = []
    known: set[int] = set()
    next_hash = 1
    now = 0.0
    for _ in range(3000):
        op = rng.random()
        if op < 0.3 and pool.num_free_blocks:
            held += pool.allocate(rng.randint(1, min(3, pool.num_free_blocks)))
            pool.take_evicted()
        elif op < 0.45 and held:
            unnamed = sorted(b for b in set(held) if pool.block_hash(b) is None)
            if unnamed:
                chosen = rng.sample(unnamed, rng.randint(1, len(unnamed)))
                pool.cache_blocks(chosen, list(range(next_hash, next_hash + len(chosen))), None)
                next_hash += len(chosen)
        elif op < 0.55 and pool.cached_hashes():
            block = pool.lookup(rng.choice(sorted(pool.cached_hashes())))
            pool.touch([block])
            held.append(block)
        elif op < 0.7 and pool.cached_hashes():
            block = pool.lookup(rng.choice(sorted(pool.cached_hashes())))
            pool.retain([block], now + rng.choice([5.0, 50.0]))
        elif op < 0.75:
            now += rng.random() * 10
            pool.end_retention(now)
        elif held:
            pool.free([held.pop(rng.randrange(len(held)))])
        pool.check_invariants()
        replay(pool.take_events(), known)
        assert known == pool.cached_hashes()
    pool.free(held)
    pool.check_invariants()
    assert pool.num_free_blocks == 12


# ---------------------------------------------------------------- the host tier


def test_an_unretained_block_never_pushes_a_retained_one_out_of_the_host_tier():
    tier = HostTierIndex(2)
    tier.demote([EvictedBlock(0, 111, 100.0), EvictedBlock(1, 222)])
    assert tier.take_moves().demote == [(0, 0), (1, 1)]
    tier.check_invariants()
    # 333 takes the slot of the unretained 222, then 444 that of 333: never the retained 111's.
    tier.demote([EvictedBlock(2, 333), EvictedBlock(3, 444)])
    assert tier.take_moves().demote == [(2, 1), (3, 1)]
    assert [h in tier for h in (111, 222, 333, 444)] == [True, False, False, True]
    # A retained 555 takes the unretained slot; with only retained blocks held, 666 is not kept.
    tier.demote([EvictedBlock(4, 555, 200.0), EvictedBlock(5, 666)])
    assert tier.take_moves().demote == [(4, 1)]
    assert [h in tier for h in (111, 444, 555, 666)] == [True, False, True, False]
    tier.check_invariants()


def test_a_retained_block_pushes_out_the_retained_one_that_ends_first_if_it_ends_no_later():
    tier = HostTierIndex(2)
    tier.demote([EvictedBlock(0, 111, 100.0), EvictedBlock(1, 222, 200.0)])
    tier.take_moves()
    # Ending before both, 333 is not kept; ending at 150, 444 takes 111's slot (ends first).
    tier.demote([EvictedBlock(2, 333, 50.0), EvictedBlock(3, 444, 150.0)])
    assert tier.take_moves().demote == [(3, 0)]
    assert [h in tier for h in (111, 222, 333, 444)] == [False, True, False, True]
    assert tier.retained_until(444) == 150.0
    # A slot a promotion reads this step is locked, retained or not.
    tier.promote([444], [9])
    tier.demote([EvictedBlock(4, 555, 300.0)])
    moves = tier.take_moves()
    assert moves.promote == [(0, 9)] and moves.demote == [(4, 1)]
    assert 222 not in tier and 555 in tier and tier.num_retained == 2
    tier.check_invariants()


def test_a_host_retention_that_ends_leaves_the_block_as_if_used_then():
    tier = HostTierIndex(3)
    tier.demote([EvictedBlock(0, 111, 100.0), EvictedBlock(1, 222), EvictedBlock(2, 333)])
    tier.take_moves()
    tier.end_retention(99.0)
    assert tier.num_retained == 1
    tier.end_retention(100.0)
    tier.check_invariants()
    assert tier.num_retained == 0
    # 111 is the most recent now: 222 and 333 go first.
    tier.demote([EvictedBlock(3, 444), EvictedBlock(4, 555), EvictedBlock(5, 666)])
    assert tier.take_moves().demote == [(3, 1), (4, 2), (5, 0)]
    assert [h in tier for h in (111, 222, 333)] == [False, False, False]


def test_a_block_held_again_with_retention_becomes_retained():
    tier = HostTierIndex(2)
    tier.demote([(0, 111), (1, 222)])
    tier.demote([EvictedBlock(5, 222, 80.0)])
    assert tier.take_moves().demote == [(0, 0), (1, 1)]
    assert tier.retained_until(222) == 80.0
    tier.demote([(2, 333)])
    assert tier.take_moves().demote == [(2, 0)]
    assert [h in tier for h in (111, 222, 333)] == [False, True, True]
    tier.check_invariants()
