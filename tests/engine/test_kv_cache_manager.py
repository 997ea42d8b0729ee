"""KV cache manager: prefix hits, the last-token rule, naming of full blocks, free order, events."""

from __future__ import annotations

import random

import pytest
from test_block_pool import replay

from cachet.block_hash import block_hashes
from cachet.engine.block_pool import BlockPool, BlocksRemoved, BlocksStored
from cachet.engine.kv_cache_manager import KVCacheManager
from cachet.engine.request import Request
from cachet.engine.sampling_params import SamplingParams

MODEL = "tiny"
BS = 4


def make_request(request_id: str, prompt: list[int], salt: str = "") -> Request:
    return Request(request_id, list(prompt), SamplingParams(), max_tokens=16, cache_salt=salt)


def make_kv(num_blocks: int, *, caching: bool = True) -> KVCacheManager:
    return KVCacheManager(BlockPool(num_blocks, enable_caching=caching), model=MODEL, block_size=BS)


def compute(kv: KVCacheManager, request: Request, num_tokens: int) -> None:
    """What the scheduler does after a step: advance computed tokens, name full blocks."""
    request.num_computed_tokens += num_tokens
    kv.cache_computed_blocks(request)


def admit(kv: KVCacheManager, request: Request) -> list[int]:
    """Schedule a whole prompt: cache hits plus fresh blocks; compute it."""
    hits, num_hit = kv.get_computed_blocks(request)
    new = kv.allocate_slots(request, request.num_tokens - num_hit, hits)
    assert new is not None
    request.num_computed_tokens = num_hit
    compute(kv, request, request.num_tokens - num_hit)
    kv.check_invariants([request])
    return new


PROMPT = list(range(10, 20))  # 10 tokens: blocks [10..13] [14..17] and a partial [18, 19]


def test_first_request_allocates_and_names_only_full_computed_blocks():
    kv = make_kv(8)
    request = make_request("a", PROMPT)
    assert kv.get_computed_blocks(request) == ([], 0)
    assert kv.allocate_slots(request, 6) == [0, 1]
    kv.check_invariants([request])
    compute(kv, request, 6)
    h = block_hashes(PROMPT, MODEL, block_size=BS)
    assert request.block_hashes == h
    # Only block 0 is full *and* computed after 6 tokens.
    assert kv.take_events() == [BlocksStored((h[0],), None)]
    assert kv.allocate_slots(request, 4) == [2]
    compute(kv, request, 4)
    assert kv.take_events() == [BlocksStored((h[1],), h[0])]
    assert kv.block_ids("a") == [0, 1, 2]
    kv.check_invariants([request])


def test_second_request_shares_leading_blocks_without_copy():
    kv = make_kv(8)
    admit(kv, make_request("a", PROMPT))
    b = make_request("b", PROMPT[:8] + [99, 98, 97, 96, 95])
    hits, num_hit = kv.get_computed_blocks(b)
    assert (hits, num_hit) == ([0, 1], 8)
    assert kv.allocate_slots(b, 5, hits) == [3, 4]
    assert kv.block_ids("b") == [0, 1, 3, 4]
    assert [kv.pool.ref_count(i) for i in range(5)] == [2, 2, 1, 1, 1]
    b.num_computed_tokens = 8
    kv.check_invariants([b])


@pytest.mark.parametrize(("prompt_len", "expected_hit_tokens"), [(8, 4), (9, 8), (5, 4), (4, 0), (1, 0)])
def test_last_prompt_token_is_never_taken_from_cache(prompt_len, expected_hit_tokens):
    kv = make_kv(8)
    admit(kv, make_request("a", PROMPT))
    _, num_hit = kv.get_computed_blocks(make_request("b", PROMPT[:prompt_len]))
    assert num_hit == expected_hit_tokens


def test_cache_salt_and_model_isolate_caches():
    kv = make_kv(8)
    admit(kv, make_request("a", PROMPT))
    assert kv.get_computed_blocks(make_request("b", PROMPT, salt="tenant-2")) == ([], 0)
    other_model = KVCacheManager(kv.pool, model="other", block_size=BS)
    assert other_model.get_computed_blocks(make_request("c", PROMPT)) == ([], 0)


def test_free_returns_blocks_tail_first_and_eviction_takes_the_tail_first():
    kv = make_kv(4)
    a = make_request("a", PROMPT)
    admit(kv, a)
    h = a.block_hashes
    kv.free(a)
    kv.check_invariants()
    # Block 2 (partial, unnamed) to the head; then the tail of the named chain.
    assert kv.pool.free_block_ids() == [2, 3, 1, 0]
    kv.take_events()
    c = make_request("c", [7] * 15)  # needs 4 blocks: evicts 1 (h[1]) then 0 (h[0])
    assert kv.allocate_slots(c, 15) == [2, 3, 1, 0]
    assert kv.take_events() == [BlocksRemoved((h[1], h[0]))]
    kv.check_invariants([c])


def test_failed_allocation_changes_nothing_and_counts_revived_hits():
    kv = make_kv(3)
    a = make_request("a", PROMPT[:9])
    admit(kv, a)
    kv.free(a)
    free_before = kv.pool.free_block_ids()
    # 13 tokens need 4 blocks: 2 hits + 2 fresh, but reviving the hits leaves 1 free.
    b = make_request("b", PROMPT[:8] + [1, 2, 3, 4, 5])
    hits, _ = kv.get_computed_blocks(b)
    assert hits == [0, 1]
    assert kv.allocate_slots(b, 5, hits) is None
    assert kv.pool.free_block_ids() == free_before
    assert [kv.pool.ref_count(i) for i in range(3)] == [0, 0, 0]
    kv.check_invariants()
    # 12 tokens need 3 blocks: 2 hits + 1 fresh fits.
    c = make_request("c", PROMPT[:8] + [1, 2, 3, 4])
    hits, _ = kv.get_computed_blocks(c)
    assert kv.allocate_slots(c, 4, hits) == [2]
    kv.check_invariants()


def test_generated_tokens_fill_and_name_blocks():
    kv = make_kv(8)
    a = make_request("a", PROMPT)  # 10 tokens
    admit(kv, a)
    kv.take_events()
    for token in (50, 51, 52):  # tokens 10, 11 end block 2 (after token 11 is computed)
        a.output_token_ids.append(token)
        assert kv.allocate_slots(a, 1) == ([3] if a.num_tokens == 13 else [])
        compute(kv, a, 1)
        kv.check_invariants([a])
    h = block_hashes(PROMPT + [50, 51, 52], MODEL, block_size=BS)
    assert kv.take_events() == [BlocksStored((h[2],), h[1])]
    # A resumed copy of the sequence hits all three full blocks.
    again = make_request("again", PROMPT + [50, 51, 52, 53])
    assert kv.get_computed_blocks(again) == ([0, 1, 2], 12)


def test_caching_disabled_never_hits():
    kv = make_kv(8, caching=False)
    admit(kv, make_request("a", PROMPT))
    assert kv.get_computed_blocks(make_request("b", PROMPT)) == ([], 0)
    assert kv.take_events() == []


def test_can_ever_fit():
    kv = make_kv(3)
    assert kv.can_ever_fit(12) and not kv.can_ever_fit(13)


def test_invariant_checker_catches_a_leaked_reference():
    kv = make_kv(4)
    admit(kv, make_request("a", PROMPT))
    kv.pool.touch([0])  # a reference no table accounts for
    with pytest.raises(AssertionError, match="block 0 has ref count 2 but 1 tables"):
        kv.check_invariants()


def test_random_requests_events_mirror_the_cache_and_refs_return_to_zero():
    rng = random.Random(7)
    kv = make_kv(12)
    stems = [[rng.randrange(50) for _ in range(12)] for _ in range(3)]
    live: dict[str, Request] = {}
    known: set[int] = set()
    for i in range(600):
        if live and (rng.random() < 0.3 or kv.num_free_blocks < 4):
            kv.free(live.pop(rng.choice(sorted(live))))
        elif rng.random() < 0.5 and live:
            request = live[rng.choice(sorted(live))]
            request.output_token_ids.append(rng.randrange(50))
            if kv.allocate_slots(request, 1) is not None:
                compute(kv, request, 1)
            else:
                request.output_token_ids.pop()
        else:
            prompt = rng.choice(stems)[: rng.randint(1, 12)] + [
                rng.randrange(50) for _ in range(rng.randint(0, 6))
            ]
            request = make_request(f"r{i}", prompt, salt=rng.choice(["", "s"]))
            hits, num_hit = kv.get_computed_blocks(request)
            if kv.allocate_slots(request, request.num_tokens - num_hit, hits) is not None:
                request.num_computed_tokens = num_hit
                compute(kv, request, request.num_tokens - num_hit)
                live[request.request_id] = request
        kv.check_invariants(live.values())
        replay(kv.take_events(), known)
        assert known == kv.pool.cached_hashes()
    for request in live.values():
        kv.free(request)
    kv.check_invariants()
    assert all(kv.pool.ref_count(b) == 0 for b in range(12))
    assert kv.num_free_blocks == 12
    assert known  # the walk did cache something
