"""KV retention: retained blocks leave each tier last, earliest retention end first; the pool's
plain LRU order is untouched without retention; retained blocks the pool must give up are
demoted to the host tier; the shared folder's clean-up spares retained files until their
retention ends. Exact block ids, slots and files; invariant checkers after every operation."""

from __future__ import annotations

import math
import os
import random
import time
from pathlib import Path

import pytest
import torch
from test_block_pool import checked, replay
from test_kv_cache_manager import BS, MODEL, compute, make_request

from cachet.block_hash import block_hashes
from cachet.engine.block_pool import BlockPool, BlocksRemoved, EvictedBlock
from cachet.engine.host_kv_tier import HostTierIndex
from cachet.engine.kv_cache_manager import KVCacheManager
from cachet.engine.kv_retention import KvRetention, RetainedKeys
from cachet.engine.request import Request
from cachet.engine.shared_kv_tier import SharedKvFiles

# ---------------------------------------------------------------- RetainedKeys


def test_retained_keys_go_earliest_deadline_first_then_in_the_order_they_became_evictable():
    keys = RetainedKeys()
    for key, until in [(1, 50.0), (2, 20.0), (3, 50.0), (4, 20.0)]:
        keys.retain([key], until)
    keys.park([3, 1, 4, 2])
    keys.check_invariants()
    assert keys.eviction_order() == [4, 2, 3, 1]
    # A retention only grows, and a longer one re-queues the key behind the equal deadlines.
    keys.retain([4], 10.0)
    keys.retain([4, 1], 50.0)
    assert keys.eviction_order() == [2, 3, 1, 4]
    # One that ends after the caller's own deadline is not taken.
    assert keys.pop(until_at_most=10.0) is None
    assert keys.pop(skip=lambda key: key == 2) == (3, 50.0)
    assert keys.eviction_order() == [2, 1, 4]
    keys.unpark(1)
    assert keys.expire(50.0) == [2, 4]  # 1 is in use: its retention ends, it was not evictable
    assert len(keys) == 0 and keys.num_evictable == 0
    keys.check_invariants()


def test_retained_keys_taken_in_bulk_end_as_one_by_one():
    """hold, exchange (with locked keys set aside for a whole batch) and pop_many against retain,
    park and pop one key at a time: same keys, deadlines and eviction order after every batch."""
    rng = random.Random(11)
    bulk, single = RetainedKeys(), RetainedKeys()
    next_key = 0
    for _ in range(400):
        held = single.eviction_order()
        locked = set(rng.sample(held, min(len(held), rng.randint(0, 3))))
        batch = [(next_key + i, rng.choice([10.0, 20.0, 30.0])) for i in range(rng.randint(1, 6))]
        next_key += len(batch)
        if rng.random() < 0.3 or not held:
            bulk.hold(batch)
            for key, until in batch:
                single.retain([key], until)
                single.park([key])
        else:
            aside: list[tuple[float, int, int]] = []
            gone = [bulk.exchange(key, until, locked.__contains__, aside) for key, until in batch]
            bulk.restore(aside)
            expected = []
            for key, until in batch:
                popped = single.pop(until_at_most=until, skip=locked.__contains__)
                expected.append(None if popped is None else popped[0])
                if popped is not None:
                    single.retain([key], until)
                    single.park([key])
            assert gone == expected
        if rng.random() < 0.2 and single.num_evictable:
            count = rng.randint(1, single.num_evictable)
            assert bulk.pop_many(count) == [single.pop() for _ in range(count)]
        bulk.check_invariants()
        assert bulk.eviction_order() == single.eviction_order()
        assert [bulk.until(k) for k in range(next_key)] == [single.until(k) for k in range(next_key)]
    with pytest.raises(AssertionError, match="found"):
        bulk.pop_many(bulk.num_evictable + 1)


class NaiveRetainedKeys:
    """RetainedKeys' contract in the plainest terms: a deadline per key, a sequence number per
    evictable key, the eviction order sorted by (deadline, sequence)."""

    def __init__(self) -> None:
        self.until: dict[int, float] = {}
        self.evictable: dict[int, int] = {}
        self.sequence = 0

    def order(self) -> list[int]:
        return sorted(self.evictable, key=lambda key: (self.until[key], self.evictable[key]))

    def park(self, keys) -> None:
        for key in keys:
            self.evictable[key] = self.sequence
            self.sequence += 1

    def retain(self, keys, until: float) -> None:
        for key in keys:
            if until > self.until.get(key, -1.0):
                self.until[key] = until
                if key in self.evictable:
                    self.park([key])

    def pop(self, until_at_most: float, skip) -> tuple[int, float] | None:
        for key in self.order():
            if self.until[key] > until_at_most:
                return None
            if not skip(key):
                del self.evictable[key]
                return key, self.until.pop(key)
        return None

    def expire(self, now: float) -> list[int]:
        ended = [key for key in self.order() if self.until[key] <= now]
        for key in [key for key, until in self.until.items() if until <= now]:
            del self.until[key]
            self.evictable.pop(key, None)
        return ended


def test_retained_keys_match_the_plain_sorted_order_through_runs_and_rebuilds():
    """Runs of keys retained and parked together, re-retained, used, popped, exchanged over
    locked keys and expired, through many heap rebuilds: the same keys, deadlines, pops and
    eviction order as sorting every key each time."""
    rng = random.Random(25)
    keys, naive = RetainedKeys(slack=0), NaiveRetainedKeys()  # rebuilt as often as it may be
    next_key, now = 0, 0.0
    for _ in range(3000):
        now += rng.random()
        op = rng.random()
        known = list(naive.until)
        if op < 0.25 or not known:  # a request: new keys and old ones, retained, then freed
            run = rng.sample(known, min(len(known), rng.randint(0, 24)))
            run += list(range(next_key, next_key + rng.randint(1, 8)))
            next_key = max(next_key, *run) + 1
            until = now + rng.choice([5.0, 10.0, 30.0, 300.0])
            for key in run:
                if key in naive.evictable:  # in use again first, as a hit is
                    keys.unpark(key)
                    del naive.evictable[key]
            keys.retain(run, until)
            naive.retain(run, until)
            keys.park(run)
            naive.park(run)
        elif op < 0.4:  # a tier's blocks: new ones, and evictable ones held again
            held_again = rng.sample(list(naive.evictable), min(len(naive.evictable), rng.randint(0, 4)))
            batch = [(key, now + rng.choice([5.0, 10.0, 30.0])) for key in held_again]
            batch += [(next_key + i, now + rng.choice([5.0, 10.0, 30.0])) for i in range(rng.randint(1, 6))]
            rng.shuffle(batch)
            next_key += len(batch)
            keys.hold(batch)
            for key, until in batch:
                if until > naive.until.get(key, -1.0):
                    naive.until[key] = until
                    naive.park([key])
        elif op < 0.55:
            locked = set(rng.sample(known, min(len(known), rng.randint(0, 3)))).__contains__
            aside: list[tuple[float, int, int]] = []
            for _ in range(rng.randint(1, 5)):
                until = now + rng.choice([5.0, 10.0, 30.0])
                expected = naive.pop(until, locked)
                got = keys.exchange(next_key, until, locked, aside)
                assert got == (None if expected is None else expected[0])
                if got is not None:
                    naive.until[next_key] = until
                    naive.park([next_key])
                    next_key += 1
            keys.restore(aside)
        elif op < 0.7 and naive.evictable:
            count = rng.randint(1, min(4, len(naive.evictable)))
            assert keys.pop_many(count) == [naive.pop(math.inf, lambda key: False) for _ in range(count)]
        elif op < 0.8 and naive.evictable:
            key = rng.choice(list(naive.evictable))
            keys.unpark(key)
            del naive.evictable[key]
        else:
            assert keys.expire(now) == naive.expire(now)
        keys.check_invariants()
        assert keys.eviction_order() == naive.order()
        assert {key: keys.until(key) for key in range(next_key) if key in keys} == naive.until


def test_retained_keys_drop_stale_copies_when_they_outnumber_live_ones():
    keys = RetainedKeys(slack=0)
    keys.retain([1, 2, 3], 1.0)
    for until in range(2, 20):  # each longer retention leaves a stale deadline behind
        keys.retain([1, 2], float(until))
        keys.check_invariants()
        assert keys._dated <= 4 * len(keys)
    keys.park([3, 2, 1])
    for _ in range(10):  # each unpark and park leaves a stale copy in the eviction queue
        keys.unpark(2)
        keys.park([2])
        keys.check_invariants()
        assert keys._queued <= 4 * keys.num_evictable
    assert keys.eviction_order() == [3, 1, 2]
    assert keys.expire(1.0) == [3]
    assert keys.expire(19.0) == [1, 2]
    assert len(keys) == 0


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


def test_one_demote_of_a_batch_pushes_out_blocks_it_held_itself():
    # Two slots of retained blocks that end at 10; three blocks ending at 50 take both, and the
    # third pushes out the first of its own batch (it ends first among those held then).
    tier = HostTierIndex(2)
    tier.demote([EvictedBlock(0, 111, 10.0), EvictedBlock(1, 222, 10.0)])
    tier.take_moves()
    tier.demote([EvictedBlock(2, 333, 50.0), EvictedBlock(3, 444, 50.0), EvictedBlock(4, 555, 50.0)])
    assert tier.take_moves().demote == [(2, 0), (3, 1), (4, 0)]
    assert tier.eviction_order() == [444, 555]
    assert [tier.retained_until(h) for h in (333, 444, 555)] == [None, 50.0, 50.0]
    tier.check_invariants()


def test_one_demote_steps_over_locked_retained_blocks_and_keeps_them():
    tier = HostTierIndex(3)
    tier.demote([EvictedBlock(0, 111, 10.0), EvictedBlock(1, 222, 20.0), EvictedBlock(2, 333, 30.0)])
    tier.take_moves()
    tier.promote([111, 222], [7, 8])
    # Only 333's slot can be taken: the first block takes it; the second, ending before that
    # one, finds none it outranks past the locked two.
    tier.demote([EvictedBlock(3, 444, 40.0), EvictedBlock(4, 555, 35.0)])
    moves = tier.take_moves()
    assert moves.promote == [(0, 7), (1, 8)] and moves.demote == [(3, 2)]
    assert tier.eviction_order() == [111, 222, 444]
    tier.check_invariants()
    # Unlocked next step, the locked blocks go first again, in their order.
    tier.demote([EvictedBlock(5, 666, 40.0)])
    assert tier.take_moves().demote == [(5, 0)]
    assert tier.eviction_order() == [222, 444, 666]


def test_one_demote_of_many_blocks_ends_as_one_demote_per_block_would():
    """The batch drops, duplicates and reorders nothing: random traffic on a small tier (full of
    retained and locked blocks, batches longer than the tier, hashes repeated in a batch), one
    tier fed whole batches and one fed the same blocks one call each, compared after every step."""
    rng = random.Random(25)
    batched, single = HostTierIndex(6), HostTierIndex(6)
    now = 0.0
    seen = {"dropped": 0, "slot twice in a step": 0, "held again in its batch": 0, "locked": 0}
    next_block = 0
    for _ in range(1500):
        if rng.random() < 0.3 and len(batched):
            chosen = rng.sample(batched.eviction_order(), rng.randint(1, min(3, len(batched))))
            blocks = list(range(next_block, next_block + len(chosen)))
            next_block += len(chosen)
            batched.promote(chosen, blocks)
            single.promote(chosen, blocks)
            seen["locked"] += 1
        batch = []
        for _ in range(rng.randint(1, 9)):
            until = rng.choice([0.0, 0.0, now + 10, now + 20, now + 40])
            batch.append(EvictedBlock(next_block, rng.randrange(40), until))
            next_block += 1
        hashes = [block.block_hash for block in batch]
        seen["held again in its batch"] += len(hashes) != len(set(hashes))
        batched.demote(batch)
        for block in batch:
            single.demote([block])
        moves = batched.take_moves()
        assert moves == single.take_moves()
        slots = [slot for _, slot in moves.demote]
        seen["slot twice in a step"] += len(slots) != len(set(slots))
        seen["dropped"] += len(moves.demote) < len(batch) - sum(h in batched for h in hashes)
        assert batched.take_events() == single.take_events()
        order = batched.eviction_order()
        assert order == single.eviction_order()
        assert [batched.retained_until(h) for h in order] == [single.retained_until(h) for h in order]
        batched.check_invariants()
        if rng.random() < 0.2:
            now += rng.choice([5.0, 15.0])
            batched.end_retention(now)
            single.end_retention(now)
    assert all(seen.values()), seen


@pytest.mark.parametrize(
    ("corrupt", "message"),
    [
        (lambda t: t._slots.__setitem__(111, 0), "both retained and not"),
        (lambda t: t._free_slots.append(0), "slots held or free"),
        (lambda t: t._retained.forget(111), "have no retention"),
        (lambda t: t._retained._evictable.pop(111), "not evictable"),
    ],
)
def test_the_host_tier_invariant_checker_catches_broken_retention(corrupt, message):
    tier = HostTierIndex(3)
    tier.demote([EvictedBlock(0, 111, 100.0), EvictedBlock(1, 222)])
    tier.check_invariants()
    corrupt(tier)
    with pytest.raises(AssertionError, match=message):
        tier.check_invariants()


# ---------------------------------------------------------------- the KV cache manager

# 13 tokens: three full blocks of 4, and a last token that is always computed.
PROMPT_A = list(range(100, 113))
PROMPT_B = list(range(200, 213))


class Clock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def manager(num_blocks: int, host_slots: int = 0, clock: Clock | None = None) -> KVCacheManager:
    return KVCacheManager(
        BlockPool(num_blocks),
        model=MODEL,
        block_size=BS,
        host_tier=HostTierIndex(host_slots) if host_slots else None,
        clock=clock or Clock(),
    )


def run(kv: KVCacheManager, request: Request) -> tuple[list[int], int]:
    """Admit a whole prompt, compute it and free it: (its block table, its hit tokens)."""
    hits, num_hit = kv.get_computed_blocks(request)
    assert kv.allocate_slots(request, request.num_tokens - num_hit, hits) is not None
    table = kv.block_ids(request.request_id)
    request.num_computed_tokens = num_hit
    compute(kv, request, request.num_tokens - num_hit)
    kv.check_invariants([request])
    kv.free(request)
    kv.check_invariants()
    return table, num_hit


def retained(request_id: str, prompt: list[int], *spans: KvRetention) -> Request:
    request = make_request(request_id, prompt)
    request.retention = spans
    return request


@pytest.mark.parametrize("retain", [False, True])
def test_the_manager_evicts_unretained_blocks_before_a_retained_prefix(retain: bool):
    clock = Clock()
    kv = manager(8, clock=clock)
    a = retained("a", PROMPT_A, KvRetention(300)) if retain else make_request("a", PROMPT_A)
    assert run(kv, a) == ([0, 1, 2, 3], 0)
    assert run(kv, make_request("b", PROMPT_B)) == ([3, 4, 5, 6], 0)
    hashes_a = block_hashes(PROMPT_A, MODEL, block_size=BS)
    assert kv.num_retained_blocks == {"engine": 3 if retain else 0, "host": 0}
    if retain:
        assert [kv.pool.retained_until(b) for b in (0, 1, 2)] == [1300.0] * 3
    # c needs 4 blocks: b's unnamed tail and the unused block 7 first, then two named blocks:
    # a's, tail first (freed first), without retention; b's with a retained.
    table_c, _ = run(kv, make_request("c", list(range(300, 313))))
    assert table_c == ([6, 7, 5, 4] if retain else [6, 7, 2, 1])
    assert kv.get_computed_blocks(make_request("a2", PROMPT_A))[1] == (12 if retain else 4)
    assert kv.pool.lookup(hashes_a[0]) == 0


def test_a_span_retains_only_the_whole_blocks_it_covers_and_the_longest_wins():
    clock = Clock()
    kv = manager(8, clock=clock)
    # 9 tokens cover blocks 0 and 1 (block 2 holds tokens 8..11: cut short, not retained).
    request = retained("a", PROMPT_A, KvRetention(60, num_tokens=9), KvRetention(3600, num_tokens=4))
    run(kv, request)
    assert [kv.pool.retained_until(b) for b in range(4)] == [4600.0, 1060.0, None, None]
    assert kv.block_retentions == 2
    # The retention ends 60 s later for block 1, and only when a later allocation looks.
    clock.now = 1060.0
    assert kv.pool.retained_until(1) == 1060.0
    run(kv, make_request("b", PROMPT_B))
    assert kv.pool.retained_until(1) is None and kv.pool.retained_until(0) == 4600.0


def test_retained_blocks_the_pool_gives_up_are_demoted_with_their_retention():
    clock = Clock()
    kv = manager(4, host_slots=3, clock=clock)
    run(kv, retained("a", PROMPT_A, KvRetention(300)))
    assert kv.take_block_moves().demote == []
    # b takes the whole pool: a's retained blocks must go, and go to the host tier.
    assert run(kv, make_request("b", PROMPT_B))[0] == [3, 2, 1, 0]
    assert kv.take_block_moves().demote == [(2, 0), (1, 1), (0, 2)]
    hashes_a = block_hashes(PROMPT_A, MODEL, block_size=BS)
    assert [kv.host_tier.retained_until(h) for h in hashes_a] == [1300.0] * 3
    assert kv.num_retained_blocks == {"engine": 0, "host": 3}
    # c pushes b's blocks out of the pool; the host tier keeps a and drops b's.
    run(kv, make_request("c", list(range(300, 313))))
    moves = kv.take_block_moves()
    assert moves.demote == []
    assert all(h in kv.host_tier for h in hashes_a)
    # a comes back from the host tier: every full block counts as cached.
    assert kv.get_computed_blocks(make_request("a2", PROMPT_A)) == ([], 12)


def test_cached_tokens_are_the_same_from_the_pool_the_host_tier_and_the_shared_folder(tmp_path: Path):
    clock = Clock()
    # Block shape of nothing in particular: the manager never reads the bytes.
    shared = SharedKvFiles(tmp_path, "tiny", budget_bytes=1 << 20, block_shape=(1,), dtype=torch.float32)
    kv = KVCacheManager(
        BlockPool(4), model=MODEL, block_size=BS, host_tier=HostTierIndex(3), shared_tier=shared, clock=clock
    )
    hashes_a = block_hashes(PROMPT_A, MODEL, block_size=BS)
    run(kv, make_request("a", PROMPT_A))
    assert [h for _, h in kv.take_block_moves().store] == hashes_a
    for h in hashes_a:  # what the runner does with the store orders
        shared.write_later(h, torch.zeros(1))
    shared.drain()
    assert run(kv, make_request("from-pool", PROMPT_A))[1] == 12
    run(kv, make_request("b", PROMPT_B))  # a's blocks go down to the host tier
    assert run(kv, make_request("from-host", PROMPT_A))[1] == 12
    # A replica with an empty pool and host tier, seeing the same folder.
    fresh = KVCacheManager(
        BlockPool(4), model=MODEL, block_size=BS, host_tier=HostTierIndex(3), shared_tier=shared, clock=clock
    )
    request = make_request("from-shared", PROMPT_A)
    assert fresh.start_prefetch(request) is not None
    request.kv_prefetch.result()
    assert run(fresh, request)[1] == 12
    assert fresh.hit_tokens == {"engine": 0, "host": 0, "shared": 12, "transfer": 0}
    shared.close()


def test_a_retained_request_retains_its_shared_files(tmp_path: Path):
    clock = Clock(time.time())
    shared = SharedKvFiles(
        tmp_path, "tiny", budget_bytes=1 << 20, block_shape=(1,), dtype=torch.float32, clock=clock
    )
    kv = KVCacheManager(
        BlockPool(8), model=MODEL, block_size=BS, host_tier=HostTierIndex(3), shared_tier=shared, clock=clock
    )
    hashes_a = block_hashes(PROMPT_A, MODEL, block_size=BS)
    run(kv, retained("a", PROMPT_A, KvRetention(86400, num_tokens=8)))
    # The request ended before the runner wrote its blocks: the retention waits for the files.
    for h in hashes_a:
        shared.write_later(h, torch.zeros(1))
    shared.drain()
    mtimes = [shared.path(h).stat().st_mtime for h in hashes_a]
    assert mtimes[:2] == [pytest.approx(clock.now + 86400)] * 2
    assert mtimes[2] <= clock.now + 1
    shared.close()


# ---------------------------------------------------------------- the shared folder


def block_files(tmp_path: Path, count: int, budget_files: float, clock: Clock) -> tuple[SharedKvFiles, int]:
    """A folder of ``count`` files, hash h last used at ``clock.now - 100 + h``."""
    tier = SharedKvFiles(
        tmp_path, "tiny", budget_bytes=1, block_shape=(2, 3), dtype=torch.float32, clock=clock
    )
    for h in range(count):
        tier.write_later(h, torch.full((2, 3), float(h)))
        tier.drain()
        past = clock.now - 100 + h
        os.utime(tier.path(h), (past, past))
    size = tier.path(0).stat().st_size
    tier.budget_bytes = int(budget_files * size)
    return tier, size


def present(tier: SharedKvFiles, count: int) -> list[int]:
    return [h for h in range(count) if tier.contains(h)]


def test_the_clean_up_spares_retained_files_while_unretained_ones_meet_the_budget(tmp_path: Path):
    clock = Clock(time.time())
    tier, _ = block_files(tmp_path, 6, budget_files=4.5, clock=clock)
    tier.retain([0, 1], clock.now + 3600)
    tier.drain()
    tier.clean_up()
    # Down to 90% of the budget (4 files): the oldest unretained ones go, 0 and 1 stay.
    assert present(tier, 6) == [0, 1, 4, 5]
    # Reading a retained file never shortens its retention.
    assert tier.read(0) is not None
    assert tier.path(0).stat().st_mtime == pytest.approx(clock.now + 3600)
    tier.close()


def test_retained_files_go_only_past_the_budget_the_earliest_ending_first(tmp_path: Path):
    clock = Clock(time.time())
    tier, _ = block_files(tmp_path, 5, budget_files=2.5, clock=clock)
    tier.retain([0], clock.now + 7200)
    tier.retain([1, 2], clock.now + 3600)
    tier.retain([3], clock.now + 60)
    tier.drain()
    tier.clean_up()
    # 4 is the only unretained file; then 3 (ends first), then 1 or 2, down to the budget
    # itself (2 files), not to 90% of it: 1 and 2 end together, 1 was older.
    assert present(tier, 5) == [0, 2]
    tier.close()


def test_a_retention_set_by_one_replica_binds_another_ones_clean_up(tmp_path: Path):
    clock = Clock(time.time())
    writer, _ = block_files(tmp_path, 4, budget_files=10, clock=clock)
    writer.retain([0], clock.now + 86400)
    writer.drain()
    other = SharedKvFiles(
        tmp_path, "tiny", budget_bytes=writer.budget_bytes, block_shape=(2, 3), dtype=torch.float32
    )
    size = writer.path(0).stat().st_size
    other.budget_bytes = 3 * size
    other.clean_up()
    assert present(other, 4) == [0, 3]
    # Once the retention has ended (24 h later), the file ages from then, as if used then:
    # newer than 3, which goes first.
    later = SharedKvFiles(
        tmp_path,
        "tiny",
        budget_bytes=int(1.5 * size),
        block_shape=(2, 3),
        dtype=torch.float32,
        clock=lambda: clock.now + 86401,
    )
    later.clean_up()
    assert present(later, 4) == [0]
    for tier in (writer, other, later):
        tier.close()
