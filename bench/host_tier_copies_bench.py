"""The host KV tier's copies of one step: 256 blocks of the default model's shape demoted and
promoted one block at a time, as before issue 25, and together (``HostKvBlocks``), same
process, best of several runs; on one math thread, as the engine runs, and on CUDA where there
is one. Slots in one run and blocks in runs (as replayed steps have them), and both scattered.

And the index's side (``HostTierIndex``, no KV): steps of 256 retained evictions, a third of
them held already, into a tier of 16,000 slots that retained blocks fill, 64 of them promoted
(locked) each step; what ``cachet replay`` spends most of its time on with retention. Its
figure before a change comes from the same function run against the older tree.
`python -m bench.host_tier_copies_bench`.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from functools import partial

import torch

from bench.engine_bench import one_math_thread
from bench.progress import progress
from cachet.block_hash import DEFAULT_BLOCK_SIZE
from cachet.engine.block_pool import EvictedBlock
from cachet.engine.host_kv_blocks import HostKvBlocks
from cachet.engine.host_kv_tier import HostTierIndex
from cachet.engine.model_runner import default_dtype
from cachet.engine.step_plan import KvBlockMoves

# The default model (SmolLM2-135M): 30 layers, 3 KV heads of 64; [layers, 2, blocks, ...].
LAYERS, KV_HEADS, HEAD_DIM = 30, 3, 64
BLOCKS = 256


def run_host_tier_copies_bench(quick: bool = False) -> dict:
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    results: dict[str, dict[str, float]] = {}
    with one_math_thread():
        for device in devices:
            results[device] = _bench_device(torch.device(device), repeats=3 if quick else 7)
    _print_table(results)
    index_us = index_us_per_block(steps=100 if quick else 300)
    print(f"\nHost tier index: {index_us:.2f} us per retained eviction (best of 3)")
    return {**results, "index_us_per_evicted_block": index_us}


def index_us_per_block(steps: int = 300, slots: int = 16_000, batch: int = 256) -> float:
    """Microseconds per evicted block of ``HostTierIndex``'s step: promote, demote, take the
    moves and events, end due retentions; best of three runs."""
    best = float("inf")
    for _ in range(3):
        rng = random.Random(0)
        tier = HostTierIndex(slots)
        now, next_hash, spent = 0.0, 0, 0.0
        held: list[int] = []
        for step in range(steps):
            if step % 50 == 0:
                held = tier.eviction_order()
            until = now + 600 + rng.randrange(60)
            evicted = []
            for i in range(batch):
                if held and i % 3 == 0:
                    block_hash = held[rng.randrange(len(held))]
                else:
                    block_hash, next_hash = next_hash, next_hash + 1
                evicted.append(EvictedBlock(step * batch + i, block_hash, until))
            promoted = [h for h in rng.sample(held, min(64, len(held))) if h in tier]
            start = time.perf_counter()
            tier.promote(promoted, range(len(promoted)))
            tier.demote(evicted)
            tier.take_moves()
            tier.take_events()
            tier.end_retention(now)
            spent += time.perf_counter() - start
            now += 5.0
        best = min(best, spent)
    return 1e6 * best / (steps * batch)


def _bench_device(device: torch.device, repeats: int) -> dict[str, float]:
    dtype = default_dtype(device)
    pool_blocks, num_slots = 4 * BLOCKS, 8 * BLOCKS
    cache = torch.randn(LAYERS, 2, pool_blocks, DEFAULT_BLOCK_SIZE, KV_HEADS, HEAD_DIM, device=device).to(
        dtype
    )
    host = HostKvBlocks(cache, block_dim=2, num_slots=num_slots)
    host.blocks.copy_(torch.randn(host.blocks.shape).to(dtype))
    mib = BLOCKS * host.blocks[0].numel() * host.blocks.element_size() / (1 << 20)
    progress(f"{device}: {BLOCKS} blocks of {mib / BLOCKS * 1024:.0f} KiB ({dtype}), {mib:.0f} MiB a step")
    rng = random.Random(0)
    # As a replay's steps have them: one run of slots, pool blocks in runs of about 8 (freed
    # together, evicted together); or both scattered.
    starts = rng.sample(range(0, pool_blocks, 8), BLOCKS // 8)
    layouts = {
        "runs": ([b for start in starts for b in range(start, start + 8)], list(range(100, 100 + BLOCKS))),
        "scattered": (rng.sample(range(pool_blocks), BLOCKS), rng.sample(range(num_slots), BLOCKS)),
    }
    timings = {}
    for layout, (block_ids, slots) in layouts.items():
        demote = KvBlockMoves(demote=list(zip(block_ids, slots, strict=True)))
        promote = KvBlockMoves(promote=list(zip(slots, block_ids, strict=True)))
        for name, copy in (
            (f"demote {layout}, one by one", partial(_one_by_one, host, demote)),
            (f"demote {layout}, together", partial(host.copy_out, demote)),
            (f"promote {layout}, one by one", partial(_one_by_one, host, promote)),
            (f"promote {layout}, together", partial(host.copy_in, promote)),
        ):
            timings[name] = _best(copy, device, repeats)
    return timings


def _one_by_one(host: HostKvBlocks, moves: KvBlockMoves) -> None:
    """The copies as ``HostKvBlocks`` made them before issue 25."""
    for block_id, slot in moves.demote:
        host.blocks[slot].copy_(host.kv_cache.select(2, block_id), non_blocking=host.on_cuda)
    for slot, block_id in moves.promote:
        host.kv_cache.select(2, block_id).copy_(host.blocks[slot], non_blocking=host.on_cuda)


def _best(copy: Callable[[], None], device: torch.device, repeats: int) -> float:
    """Milliseconds of the fastest of ``repeats`` runs, after one to warm up."""
    best = float("inf")
    for _ in range(repeats + 1):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        copy()
        if device.type == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return 1000 * best


def _print_table(results: dict[str, dict[str, float]]) -> None:
    print(f"\nHost KV tier copies: {BLOCKS} blocks a step, one by one against together (ms, best run)")
    print(f"{'device':<8}{'copies':<22}{'one by one':>12}{'together':>10}{'ratio':>8}")
    print("-" * 60)
    for device, timings in results.items():
        for copies in ("demote runs", "demote scattered", "promote runs", "promote scattered"):
            old, new = timings[f"{copies}, one by one"], timings[f"{copies}, together"]
            print(f"{device:<8}{copies:<22}{old:>12.2f}{new:>10.2f}{new / old:>8.2f}")


if __name__ == "__main__":
    run_host_tier_copies_bench()
