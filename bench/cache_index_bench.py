"""The cache index at scale: memory for 1M (replica, block) entries and the latency of a 2,000-block lookup.

Targets: 1,000,000 blocks held across replicas in under 200 MB, and a lookup of a
2,000-block chain in under 1 ms (p50).

What is measured, in a fresh subprocess (so nothing else shares the heap):

* **memory**: ``tracemalloc``'s count of bytes the index's structures hold after
  every stored event is applied (Python allocations only; the index has no other
  kind). Block hashes are uniform random 64-bit ints, the same distribution as
  the BLAKE2b-64 chain hashes engines send (hashing 2.5M tokens would only slow
  the setup). 8 replicas of one model each hold 125,000 blocks in chains of
  2,500; every chain is held by two neighbouring replicas (shared system
  prompts), so the index holds 1,000,000 (replica, block) pairs over 500,000
  distinct hashes. A second figure has no sharing at all: 1,000,000 distinct
  hashes, the worst case for the index's size.
* **lookup**: ``PrefixIndex.match`` wall time for a 2,000-block chain, three shapes:
  a full hit on two replicas (every block walked), a hit that ends halfway (the
  walk drops candidates), and a miss at block 0. The median and p99 of many runs.

Run alone: ``python -m bench.cache_index_bench [--quick]`` prints the JSON.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import time
import tracemalloc
from typing import Any

from cachet.cache.prefix_index import PrefixIndex

MODEL = "bench-model"
REPLICAS = 8
CHAIN_BLOCKS = 2_000  # blocks in a lookup
STORED_CHAIN_BLOCKS = 2_500  # blocks in each cached prompt
MEMORY_TARGET_MB = 200.0
LOOKUP_TARGET_MS = 1.0


def _chain(rng: random.Random, blocks: int) -> list[int]:
    return [rng.getrandbits(64) for _ in range(blocks)]


def build_index(total_blocks: int, shared: bool = True, seed: int = 0) -> tuple[PrefixIndex, list[list[int]]]:
    """``total_blocks`` (replica, block) pairs over ``REPLICAS`` replicas; returns the index and every chain.

    Shared: replica r holds its own chains and those of replica r-1 (a ring), half
    and half. Not shared: every replica holds only its own (every hash distinct).
    """
    rng = random.Random(seed)
    chains_per_replica = max(2, total_blocks // REPLICAS // STORED_CHAIN_BLOCKS)
    own_count = chains_per_replica // 2 if shared else chains_per_replica
    own = [[_chain(rng, STORED_CHAIN_BLOCKS) for _ in range(own_count)] for _ in range(REPLICAS)]
    index = PrefixIndex()
    for replica in range(REPLICAS):
        held = own[replica] + own[replica - 1] if shared else own[replica]
        for chain in held:
            index.apply_stored(f"10.0.0.{replica}:50061", MODEL, chain)
    return index, [chain for chains in own for chain in chains]


def measure_memory(total_blocks: int, shared: bool) -> dict[str, Any]:
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    index, chains = build_index(total_blocks, shared)
    # The chains list holds its own references to the hash ints: drop it before counting.
    del chains
    held = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    pairs, distinct = index.total_blocks(), index.distinct_blocks()
    return {
        "blocks": pairs,
        "distinct_hashes": distinct,
        "replicas": len(index.replicas()),
        "memory_mb": held / 1e6,
        "bytes_per_block": held / pairs,
        "memory_target_mb": MEMORY_TARGET_MB,
    }


def _time_lookups(index: PrefixIndex, chain: list[int], runs: int) -> dict[str, float]:
    samples = []
    for _ in range(runs):
        started = time.perf_counter_ns()
        index.match(MODEL, chain)
        samples.append((time.perf_counter_ns() - started) / 1e6)
    samples.sort()
    return {"p50_ms": statistics.median(samples), "p99_ms": samples[int(len(samples) * 0.99) - 1]}


def measure_lookups(total_blocks: int, runs: int) -> dict[str, Any]:
    index, chains = build_index(total_blocks)
    shared = chains[0][:CHAIN_BLOCKS]  # replica 0's first chain: also held by replica 1
    full = [m.matched_blocks for m in index.match(MODEL, shared)]
    assert full == [CHAIN_BLOCKS, CHAIN_BLOCKS], full
    halfway = shared[: CHAIN_BLOCKS // 2] + _chain(random.Random(1), CHAIN_BLOCKS // 2)
    miss = _chain(random.Random(2), CHAIN_BLOCKS)
    assert index.match(MODEL, miss) == []
    return {
        "query_blocks": CHAIN_BLOCKS,
        "full_hit_on_two_replicas": _time_lookups(index, shared, runs),
        "hit_ends_halfway": _time_lookups(index, halfway, runs),
        "miss_at_block_0": _time_lookups(index, miss, runs),
        "lookup_target_ms": LOOKUP_TARGET_MS,
    }


def measure(total_blocks: int, runs: int) -> dict[str, Any]:
    return {
        "memory": measure_memory(total_blocks, shared=True),
        "memory_all_distinct": measure_memory(total_blocks, shared=False),
        "lookup": measure_lookups(total_blocks, runs),
    }


def run_cache_index_bench(quick: bool = False) -> dict[str, Any]:
    """In its own process, so the heap holds the index alone; prints a table, returns the figures."""
    print("[bench] cache index (own process)", flush=True)
    command = [sys.executable, "-m", "bench.cache_index_bench", *(["--quick"] if quick else [])]
    result = json.loads(subprocess.run(command, check=True, stdout=subprocess.PIPE).stdout)
    lookup = result["lookup"]
    print("\nCache index (PrefixIndex, in-process)")
    print(f"{'measure':<66}{'value':>10}{'target':>10}")
    print("-" * 88)
    for key in ("memory", "memory_all_distinct"):
        memory = result[key]
        blocks = f"MB for {memory['blocks']:,} blocks, {memory['distinct_hashes']:,} distinct, {memory['replicas']} replicas"
        print(f"{blocks:<66}{memory['memory_mb']:>10.1f}{'< 200':>10}")
    for shape in ("full_hit_on_two_replicas", "hit_ends_halfway", "miss_at_block_0"):
        figures = lookup[shape]
        label = f"lookup of {lookup['query_blocks']:,} blocks, {shape.replace('_', ' ')} (ms p50 / p99)"
        print(f"{label:<66}{figures['p50_ms']:>5.3f} /{figures['p99_ms']:>6.3f}{'< 1 (p50)':>10}")
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--quick", action="store_true", help="fewer lookup runs (the index is still 1M blocks)"
    )
    args = parser.parse_args()
    print(json.dumps(measure(1_000_000, runs=50 if args.quick else 500)))


if __name__ == "__main__":
    main()
