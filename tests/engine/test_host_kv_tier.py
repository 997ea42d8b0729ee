"""The host KV tier: evictions demoted, prefix hits promoted, with exact block ids and slots;
and a prompt served from the host tier decodes exactly as the same prompt computed cold."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from test_kv_cache_manager import BS, MODEL, compute, make_request

from cachet.engine.block_pool import BlockPool
from cachet.engine.engine_core import EngineCore
from cachet.engine.host_kv_blocks import HostKvBlocks
from cachet.engine.host_kv_tier import HostTierIndex
from cachet.engine.kv_cache_manager import KVCacheManager
from cachet.engine.model_runner import ModelRunner
from cachet.engine.request import Request
from cachet.engine.sampling_params import SamplingParams
from cachet.engine.scheduler import SchedulerConfig
from cachet.engine.step_plan import KvBlockMoves, LoadedBlock

# 13 tokens: three full blocks of 4, and a last token that is always computed.
PROMPT_A = list(range(100, 113))
PROMPT_B = list(range(200, 213))
PROMPT_C = list(range(300, 313))


def make_kv(num_blocks: int, host_slots: int) -> KVCacheManager:
    return KVCacheManager(
        BlockPool(num_blocks), model=MODEL, block_size=BS, host_tier=HostTierIndex(host_slots)
    )


def run_whole(kv: KVCacheManager, request: Request) -> tuple[list[int], int]:
    """Admit a whole prompt, compute it and free it: (its block table, its hit tokens)."""
    hits, num_hit = kv.get_computed_blocks(request)
    assert kv.allocate_slots(request, request.num_tokens - num_hit, hits) is not None
    table = kv.block_ids(request.request_id)
    request.num_computed_tokens = num_hit
    compute(kv, request, request.num_tokens - num_hit)
    kv.free(request)
    return table, num_hit


def test_evicted_blocks_are_demoted_and_a_later_hit_promotes_them():
    kv = make_kv(num_blocks=4, host_slots=8)
    assert run_whole(kv, make_request("a", PROMPT_A)) == ([0, 1, 2, 3], 0)
    assert kv.take_block_moves() == KvBlockMoves()
    # b needs all four blocks: a's three named ones are evicted (its unnamed tail block 3 is
    # reused first and costs nothing) and copied down, in the order they were evicted.
    table_b, _ = run_whole(kv, make_request("b", PROMPT_B))
    assert table_b == [3, 2, 1, 0]
    assert kv.take_block_moves() == KvBlockMoves(demote=[(2, 0), (1, 1), (0, 2)])
    # a again: nothing of it is in the pool any more, all three blocks are in the host tier.
    again = make_request("a2", PROMPT_A)
    hits, num_hit = kv.get_computed_blocks(again)
    assert (hits, num_hit) == ([], 12)
    new = kv.allocate_slots(again, 1, hits)
    # b's unnamed tail (block 0) is reused first, at no cost; its named blocks 1, 2, 3 are
    # demoted into free slots, none into the slots 2, 1, 0 that a's promotions read.
    assert new == [0, 1, 2, 3]
    moves = kv.take_block_moves()
    assert moves.promote == [(2, 0), (1, 1), (0, 2)]
    assert moves.demote == [(1, 3), (2, 4), (3, 5)]
    assert kv.hit_tokens == {"engine": 0, "host": 12, "shared": 0, "transfer": 0}
    assert kv.block_copies == {"demote": 6, "promote": 3, "store": 0, "load": 0, "duplicate": 0, "send": 0}


def test_the_host_tier_evicts_its_least_recently_used_block_and_never_a_locked_one():
    tier = HostTierIndex(2)
    tier.demote([(0, 111), (1, 222)])
    assert tier.take_moves().demote == [(0, 0), (1, 1)]
    # A hash already held is only refreshed: 111 becomes the most recent, 222 the oldest.
    tier.demote([(5, 111)])
    assert tier.take_moves() == KvBlockMoves()
    tier.demote([(2, 333)])
    assert tier.take_moves().demote == [(2, 1)]
    assert 222 not in tier and 111 in tier and 333 in tier
    # A slot being promoted this step is locked: a demotion takes the other one, and when
    # every slot is locked the evicted block is not kept.
    tier.promote([111], [7])
    tier.demote([(3, 444)])
    tier.promote([444], [8])
    tier.demote([(4, 555)])
    moves = tier.take_moves()
    assert moves.promote == [(0, 7), (1, 8)]
    assert moves.demote == [(3, 1)]
    assert 555 not in tier
    # Next step the locks are gone.
    tier.demote([(4, 555)])
    assert tier.take_moves().demote == [(4, 0)]


def test_a_reset_prefix_cache_empties_the_host_tier():
    kv = make_kv(num_blocks=4, host_slots=8)
    run_whole(kv, make_request("a", PROMPT_A))
    run_whole(kv, make_request("b", PROMPT_B))
    kv.take_block_moves()
    assert kv.reset_prefix_cache()
    assert kv.num_host_blocks == (0, 8)
    assert kv.get_computed_blocks(make_request("a2", PROMPT_A)) == ([], 0)


def test_host_blocks_copy_whole_blocks_of_every_layer():
    # [layers, 2, blocks, block_size, heads, dim], as the pool of a K/V-per-head model.
    cache = torch.arange(3 * 2 * 5 * 2 * 1 * 2, dtype=torch.float32).view(3, 2, 5, 2, 1, 2)
    original = cache.clone()
    host = HostKvBlocks(cache, block_dim=2, num_slots=2)
    host.copy_out(KvBlockMoves(demote=[(4, 1)]))
    cache[:, :, 4] = -1
    host.copy_in(KvBlockMoves(promote=[(1, 0)]))
    assert torch.equal(cache[:, :, 0], original[:, :, 4])
    assert torch.equal(cache[:, :, 1:4], original[:, :, 1:4])


def copy_one_by_one(cache: torch.Tensor, blocks: torch.Tensor, block_dim: int, moves: KvBlockMoves) -> None:
    """The orders applied one block at a time, in turn: what the batched copies must equal."""
    for block_id, slot in moves.demote:
        blocks[slot].copy_(cache.select(block_dim, block_id))
    for slot, loaded in moves.fill:
        blocks[slot].copy_(loaded.data)
    for slot, block_id in moves.promote:
        cache.select(block_dim, block_id).copy_(blocks[slot])


def random_orders(rng: random.Random, count: int, rows: int, other_rows: int) -> list[tuple[int, int]]:
    """(read, written) orders: runs of consecutive written rows, scattered ones, rows written twice."""
    written: list[int] = []
    while len(written) < count:
        start = rng.randrange(other_rows)
        written += range(start, min(other_rows, start + rng.randint(1, 6)))
        written.append(rng.randrange(other_rows))
    return [(rng.randrange(rows), row) for row in written[:count]]


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=CUDA)])
@pytest.mark.parametrize(
    "pool_shape",
    [(3, 2, 23, 4, 2, 8), (3, 23, 4, 12)],  # [layers, 2, blocks, ...] K/V; [layers, blocks, ...] MLA
    ids=["kv", "mla"],
)
def test_a_steps_copies_together_end_as_copied_one_block_at_a_time(
    device: str, pool_shape: tuple[int, ...]
) -> None:
    """Runs of slots and of blocks, scattered ones, a slot demoted twice and a block promoted
    twice in one step (the last order wins), a slot promoted from after a demotion wrote it."""
    block_dim = 2 if len(pool_shape) == 6 else 1
    num_blocks, num_slots = pool_shape[block_dim], 17
    rng = random.Random(5)
    torch.manual_seed(5)
    cache = torch.randn(pool_shape, device=device)
    host = HostKvBlocks(cache, block_dim, num_slots)
    host.blocks.copy_(torch.randn(host.blocks.shape))
    expected_cache, expected_blocks = cache.clone(), host.blocks.clone()
    for _ in range(30):
        demote = random_orders(rng, rng.randint(0, 12), num_blocks, num_slots)
        promote = random_orders(rng, rng.randint(0, 12), num_slots, num_blocks)
        fill = (
            [(rng.randrange(num_slots), LoadedBlock(rng.getrandbits(63), torch.randn(host.blocks.shape[1:])))]
            if rng.random() < 0.3
            else []
        )
        moves = KvBlockMoves(demote=demote, promote=promote, fill=fill)
        host.copy_out(moves)
        host.copy_in(moves)
        copy_one_by_one(expected_cache, expected_blocks, block_dim, moves)
        if device == "cuda":
            torch.cuda.synchronize()
        assert torch.equal(host.blocks, expected_blocks)
        assert torch.equal(cache, expected_cache)
        # The next step's blocks hold new KV: a block copied from a stale row would show.
        cache.copy_(torch.randn(pool_shape))
        expected_cache.copy_(cache)


def greedy(
    engine: EngineCore, request_id: str, prompt: list[int], max_tokens: int
) -> tuple[list[int], list[float], int]:
    """(tokens, their logprobs, cached prompt tokens) of one greedy request run alone.

    Logprobs too: a random tiny model's argmax can survive stale KV, its logprobs cannot."""
    sampling = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=True)
    engine.add_request(Request(request_id, prompt, sampling, max_tokens=max_tokens))
    tokens: list[int] = []
    logprobs: list[float] = []
    cached = 0
    while engine.has_unfinished_requests():
        for output in engine.step():
            tokens.extend(output.new_token_ids)
            logprobs.extend(token.logprob for token in output.logprobs)
            cached = max(cached, output.num_cached_tokens)
    return tokens, logprobs, cached


@pytest.mark.parametrize(
    ("family", "device"),
    [("llama", "cpu"), ("kimi-k2", "cpu"), pytest.param("llama", "cuda", marks=CUDA)],
)
def test_a_prompt_served_from_the_host_tier_decodes_as_it_did_cold(
    tiny_checkpoints: dict[str, Path], family: str, device: str
) -> None:
    model_dir = tiny_checkpoints[family]
    block_size = 16
    # Room for one 150-token request at a time in the pool: each prompt evicts the last.
    per_block = ModelRunner(
        model_dir, dtype=torch.float32, device=torch.device("cpu"), kv_cache_bytes=64 << 20
    )._kv_cache_bytes_per_block()
    runner = ModelRunner(
        model_dir,
        dtype=torch.float32,
        device=torch.device(device),
        kv_cache_bytes=12 * per_block,
        block_size=block_size,
        host_kv_bytes=40 * per_block,
    )
    assert runner.num_kv_blocks == 12 and runner.num_host_kv_blocks == 40
    engine = EngineCore(
        runner=runner,
        model=family,
        scheduler_config=SchedulerConfig(
            max_model_len=runner.max_model_len,
            max_num_batched_tokens=64,
            max_num_seqs=4,
            eos_token_ids=tuple(runner.eos_token_ids),
        ),
    )
    generator = torch.Generator().manual_seed(3)
    prompts = [torch.randint(5, 200, (150,), generator=generator).tolist() for _ in range(3)]
    cold = [greedy(engine, f"cold-{i}", prompt, 8) for i, prompt in enumerate(prompts)]
    assert all(cached == 0 for *_, cached in cold)
    kv = engine.scheduler.kv
    # Each 150-token request (10 blocks) evicted its predecessor's named blocks into the host tier.
    assert kv.block_copies["demote"] >= 9
    for i, prompt in enumerate(prompts[:2]):
        tokens, logprobs, cached = greedy(engine, f"warm-{i}", prompt, 8)
        assert cached == 144, "every full block but the one holding the last prompt token"
        assert tokens == cold[i][0]
        assert logprobs == pytest.approx(cold[i][1], abs=1e-5)
    # The first prompt's blocks had all left the pool; the second's head may still be there.
    assert kv.hit_tokens["engine"] + kv.hit_tokens["host"] == 2 * 144
    assert kv.hit_tokens["host"] > 144
