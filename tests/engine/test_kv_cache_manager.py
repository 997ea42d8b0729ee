"""KV cache manager: prefix hits, the last-token rule, naming of full blocks, free order, events."""

from __future__ import annotations

import random

import pytest
from test_block_pool import replay

from cachet.block_hash import block_hashes
from cachet.engine.block_pool import BlockPool, BlocksRemoved, BlocksStored
from cachet.engine.kv_cache_manager import KVCacheManager
from cachet.engine.prompt_images import PromptImage
from cachet.engine.request import Request
from cachet.engine.sampling_params import SamplingParams

MODEL = "tiny"
BS = 4
# What a replica that runs batch-invariant steps names its greedy requests' KV by.
KERNELS = "cpu:panel_linear=avx2"


def make_request(request_id: str, prompt: list[int], salt: str = "") -> Request:
    return Request(request_id, list(prompt), SamplingParams(), max_tokens=16, cache_salt=salt)


def make_kv(num_blocks: int, *, caching: bool = True, reproducible_kernels: str = "") -> KVCacheManager:
    return KVCacheManager(
        BlockPool(num_blocks, enable_caching=caching),
        model=MODEL,
        block_size=BS,
        reproducible_kernels=reproducible_kernels,
    )


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


# ------------------------------------------------ copy-on-write of the last block (n > 1)


def copying(kv: KVCacheManager, request: Request, sources: list[Request]) -> tuple[list[int], int, list[int]]:
    """Admit ``request`` as the scheduler does, with ``sources`` to copy from: (hits, tokens
    not to compute, new blocks); the copies ordered stay in ``kv``."""
    hits, num_hit = kv.get_computed_blocks(request, sources)
    new = kv.allocate_slots(request, request.num_tokens - num_hit, hits)
    assert new is not None
    request.num_computed_tokens = num_hit
    kv.check_invariants([request, *sources])
    return hits, num_hit, new


def test_a_block_another_request_computed_is_copied_up_to_the_last_token():
    kv = make_kv(8)
    first = make_request("choice-0", PROMPT)  # blocks 0, 1 full, 2 holds tokens 8 and 9
    admit(kv, first)
    kv.take_block_moves()
    other = make_request("choice-1", PROMPT)
    # Token 8 is copied with block 2; token 9, the last, is computed for its logits.
    assert copying(kv, other, [first]) == ([0, 1], 9, [3])
    assert kv.take_block_moves().duplicate == [(2, 3)]
    assert kv.block_ids("choice-1") == [0, 1, 3]
    assert [kv.pool.ref_count(i) for i in range(4)] == [2, 2, 1, 1]
    assert kv.hit_tokens["engine"] == 9 and kv.block_copies["duplicate"] == 1
    assert kv.take_block_moves().duplicate == []  # each order goes into one plan


@pytest.mark.parametrize(
    ("prompt_len", "hits", "num_hit"),
    [
        (8, [0], 7),  # a whole-block prompt: its last block is named, but the last token is its own
        (3, [], 2),  # no full block: the chain before block 0 is the seed (model, salt)
        (9, [0, 1], 8),  # the last token starts a block: nothing to copy
    ],
)
def test_the_copied_block_is_the_one_the_last_token_goes_in(prompt_len, hits, num_hit):
    kv = make_kv(8)
    first = make_request("choice-0", PROMPT[:prompt_len])
    admit(kv, first)
    other = make_request("choice-1", PROMPT[:prompt_len])
    got_hits, got_num_hit, new = copying(kv, other, [first])
    assert (got_hits, got_num_hit) == (hits, num_hit)
    copied = kv.block_ids("choice-0")[len(hits)]
    assert kv.take_block_moves().duplicate == ([(copied, new[0])] if num_hit % BS else [])


def test_a_source_serves_while_it_decodes_past_the_prompt():
    kv = make_kv(8)
    first = make_request("choice-0", PROMPT)
    admit(kv, first)
    for token in (50, 51, 52):  # its answer fills block 2 and starts block 3
        first.output_token_ids.append(token)
        kv.allocate_slots(first, 1)
        compute(kv, first, 1)
    other = make_request("choice-1", PROMPT)
    assert copying(kv, other, [first])[1] == 9
    assert kv.take_block_moves().duplicate == [(2, 4)]


@pytest.mark.parametrize(
    "differs",
    ["not computed yet", "another token", "another salt", "another image", "batch-invariant"],
)
def test_no_copy_from_a_request_whose_block_holds_other_kv(differs):
    kv = make_kv(8)
    first = make_request("choice-0", PROMPT, salt="s" if differs == "another salt" else "")
    other = make_request("choice-1", PROMPT)
    if differs == "another token":
        first.prompt_token_ids[8] = 99
    if differs == "another image":
        first.images = (PromptImage(8, 1, 1, 1, b"", bytes(32)),)
        other.images = (PromptImage(8, 1, 1, 1, b"", bytes([1]) * 32),)
    if differs == "batch-invariant":
        kv = make_kv(8, reproducible_kernels=KERNELS)
        first.sampling = SamplingParams(temperature=0.0)
    if differs == "not computed yet":
        hits, _ = kv.get_computed_blocks(first)
        kv.allocate_slots(first, 10, hits)
        compute(kv, first, 8)  # token 8 is not
    else:
        admit(kv, first)
    hits, num_hit = kv.get_computed_blocks(other, [first])
    # The full blocks are still hits where the chain is the same.
    assert num_hit == (0 if differs in ("another salt", "batch-invariant") else 8)
    kv.allocate_slots(other, other.num_tokens - num_hit, hits)
    assert kv.take_block_moves().duplicate == []


@pytest.mark.parametrize("differs", ["salt", "batch-invariant"])
def test_no_copy_of_a_first_block_from_another_chain(differs):
    kv = make_kv(8, reproducible_kernels=KERNELS if differs == "batch-invariant" else "")
    first = make_request("choice-0", PROMPT[:3], salt="s" if differs == "salt" else "")
    if differs == "batch-invariant":
        first.sampling = SamplingParams(temperature=0.0)
    admit(kv, first)
    other = make_request("choice-1", PROMPT[:3])
    assert kv.get_computed_blocks(other, [first]) == ([], 0)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_only_greedy_blocks_are_named_by_the_kernels_that_computed_them(temperature):
    # Blocks in a shared tier or pushed between replicas carry their hash: a host whose kernels
    # sum in other orders must not take a greedy request's, while sampled ones stay shareable.
    here, there = (
        make_kv(8, reproducible_kernels=KERNELS),
        make_kv(8, reproducible_kernels="cpu:panel_linear=avx512"),
    )
    names = []
    for kv in (here, there):
        request = make_request("r", PROMPT)
        request.sampling = SamplingParams(temperature=temperature)
        admit(kv, request)
        names.append(request.block_hashes)
    assert len(names[0]) == 2
    assert (names[0] == names[1]) == (temperature != 0.0)


def test_a_request_freed_before_its_plan_drops_its_copy():
    kv = make_kv(8)
    first = make_request("choice-0", PROMPT)
    admit(kv, first)
    other = make_request("choice-1", PROMPT)
    copying(kv, other, [first])
    kv.free(other)  # preempted or aborted in the step that admitted it
    kv.check_invariants([first])
    assert kv.take_block_moves().duplicate == []


def test_a_preempted_request_copies_from_one_whose_output_is_the_same():
    kv = make_kv(12)
    answer = [50, 51, 52, 53, 54]  # greedy choices answer alike: PROMPT + answer is 15 tokens
    first = make_request("choice-0", PROMPT)
    first.output_token_ids = list(answer)
    admit(kv, first)
    resumed = make_request("choice-1", PROMPT)
    resumed.output_token_ids = list(answer)  # sampled before it lost its blocks
    hits, num_hit, new = copying(kv, resumed, [first])
    assert (hits, num_hit) == ([0, 1, 2], 14)
    assert kv.take_block_moves().duplicate == [(3, new[0])]


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
