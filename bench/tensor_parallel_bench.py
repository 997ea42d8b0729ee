"""Tensor parallel on CPU: TP=2 against TP=1 decode throughput, step latency, time in collectives.

Each configuration runs in its own spawned rank processes (one torch thread per rank),
driven exactly as a replica is: rank 0 runs EngineCore over a ShardedRunner, followers
run ``distributed.follow``. Collective time is the plan broadcast (gloo) plus every
row-parallel all-reduce (DeepSpeed's shared-memory op), timed around
``deepspeed.comm.inference_all_reduce``.

Expect TP to lose here: two ranks on two shared cores halve each rank's matmuls but
add two all-reduces per layer (plus the embedding's and the head's) and a broadcast per
step, and the models are small. TP pays when a model does not fit one device, or with
NVLink-connected GPUs.
"""

from __future__ import annotations

import multiprocessing
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from cachet.engine.distributed import local_group_environment
from cachet.loopback_port import free_loopback_port

STREAMS = 4


class _CollectiveClock:
    """Wall time spent inside DeepSpeed's inference all-reduce (the row-parallel sums)."""

    def __init__(self) -> None:
        import deepspeed.comm as ds_comm

        self.seconds = 0.0
        original = ds_comm.inference_all_reduce

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start

        ds_comm.inference_all_reduce = timed


def _rank(rank: int, world: int, port: int, model_dir: str, tokens: int, out: Any) -> None:
    os.environ.update(local_group_environment(rank, world, port))
    torch.set_num_threads(1)
    from cachet.engine import distributed
    from cachet.engine.engine_core import EngineCore
    from cachet.engine.model_runner import ModelRunner
    from cachet.engine.request import Request
    from cachet.engine.sampling_params import SamplingParams
    from cachet.engine.scheduler import SchedulerConfig

    tp = None
    if world > 1:
        tp = distributed.TensorParallel.create(distributed.init_distributed(torch.device("cpu")))
    clock = _CollectiveClock()
    runner = ModelRunner(
        Path(model_dir), dtype=torch.float32, device=torch.device("cpu"), kv_cache_bytes=1 << 28, tp=tp
    )
    if rank > 0:
        distributed.follow(runner, tp)
        return
    stepper = distributed.ShardedRunner(runner, tp) if tp is not None else runner
    core = EngineCore(
        runner=stepper,
        model="bench",
        scheduler_config=SchedulerConfig(
            max_model_len=runner.max_model_len,
            max_num_batched_tokens=512,
            max_num_seqs=64,
            max_waiting=64,
            eos_token_ids=(),
        ),
    )
    for index in range(STREAMS):
        prompt = [(31 * index + 7 * i) % 1000 + 10 for i in range(64)]
        core.add_request(
            Request(
                request_id=f"s{index}",
                prompt_token_ids=prompt,
                sampling=SamplingParams(max_tokens=tokens, ignore_eos=True),
                max_tokens=tokens,
                interactive=True,
                cache_salt="",
                arrival_time=time.monotonic(),
            )
        )
    core.step()  # the prefill, outside the decode timing
    clock.seconds, steps, decoded = 0.0, 0, 0
    broadcast_before = getattr(stepper, "broadcast_seconds", 0.0)
    start = time.perf_counter()
    while core.has_unfinished_requests():
        decoded += sum(len(o.new_token_ids) for o in core.step())
        steps += 1
    elapsed = time.perf_counter() - start
    collective = clock.seconds + getattr(stepper, "broadcast_seconds", 0.0) - broadcast_before
    if isinstance(stepper, distributed.ShardedRunner):
        stepper.close()
    out.put(
        {
            "tp": world,
            "decode_tokens_per_s": decoded / elapsed,
            "step_ms": 1000 * elapsed / max(steps, 1),
            "collective_share": collective / elapsed,
        }
    )


def _run(world: int, model_dir: Path, tokens: int) -> dict:
    context = multiprocessing.get_context("spawn")
    out = context.Queue()
    port = free_loopback_port()
    ranks = [
        context.Process(target=_rank, args=(rank, world, port, str(model_dir), tokens, out))
        for rank in range(world)
    ]
    for process in ranks:
        process.start()
    try:
        return out.get(timeout=900)
    finally:
        for process in ranks:
            process.join(60)
            if process.is_alive():
                process.kill()


def _load_rank(model_dir: str, rank: int, size: int, out: Any) -> None:
    """Load one rank's slices in a fresh process; report its weights and its peak RSS growth.

    Peak RSS counts the checkpoint's mmap'd pages the loader touched, not only the weights:
    a row-parallel slice (columns of a row-major tensor) touches every page of its tensor.
    """
    import resource

    from cachet.engine.models import ModelConfig
    from cachet.engine.tensor_parallel import TensorParallelRank
    from cachet.engine.weights import load_model

    torch.set_num_threads(1)
    directory = Path(model_dir)
    config = ModelConfig.from_model_dir(directory)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    model = load_model(
        directory, config, dtype=torch.float32, device=torch.device("cpu"), tp=TensorParallelRank(rank, size)
    )
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    held = sum(p.numel() * p.element_size() for p in model.parameters())
    out.put(
        {"tp": size, "rank": rank, "weights_mb": held / 2**20, "peak_rss_growth_mb": (peak - before) / 1024}
    )


def _loading_rows(model_dir: Path) -> list[dict]:
    context = multiprocessing.get_context("spawn")
    rows = []
    for rank, size in ((0, 1), (0, 2), (1, 2)):
        out = context.Queue()
        process = context.Process(target=_load_rank, args=(str(model_dir), rank, size, out))
        process.start()
        rows.append(out.get(timeout=600))
        process.join(60)
    return rows


def _print_loading(name: str, rows: list[dict]) -> None:
    print(f"\nLoading {name}: what one rank holds and its peak RSS growth (fp32)")
    print(f"{'TP':<6}{'rank':>6}{'weights MB':>12}{'peak RSS MB':>13}{'vs TP=1':>10}")
    print("-" * 47)
    for row in rows:
        ratio = row["peak_rss_growth_mb"] / rows[0]["peak_rss_growth_mb"]
        print(
            f"{row['tp']:<6}{row['rank']:>6}{row['weights_mb']:>12.0f}"
            f"{row['peak_rss_growth_mb']:>13.0f}{ratio:>9.2f}x"
        )


def _print_table(title: str, rows: list[dict], tokens: int) -> None:
    print(f"\n{title} ({STREAMS} decode streams, {tokens} tokens each)")
    print(f"{'TP':<6}{'decode tok/s':>14}{'step ms':>10}{'in collectives':>16}{'vs TP=1':>10}")
    print("-" * 56)
    for row in rows:
        ratio = row["decode_tokens_per_s"] / rows[0]["decode_tokens_per_s"]
        print(
            f"{row['tp']:<6}{row['decode_tokens_per_s']:>14.1f}{row['step_ms']:>10.1f}"
            f"{100 * row['collective_share']:>15.1f}%{ratio:>9.2f}x"
        )


def run_tensor_parallel_bench(model: str | None, quick: bool) -> dict:
    """The default (or given) model, then the tiny Kimi K2 checkpoint (MLA + MoE: a split
    latent attention, expert parallel and shared experts by channels)."""
    from cachet.models.catalog import ensure_model
    from cachet.models.tiny import write_tiny_model

    print("[bench] tensor parallel (TP=1 vs TP=2, fp32, one thread per rank)", flush=True)
    model_dir = Path(ensure_model(model, Path(os.environ.get("CACHET_DATA_DIR", "data"))).path)
    tokens = 16 if quick else 64
    results: dict[str, Any] = {"streams": STREAMS, "tokens": tokens}
    results["loading"] = _loading_rows(model_dir)
    _print_loading(model_dir.name, results["loading"])
    with tempfile.TemporaryDirectory(prefix="cachet-tp-bench-") as scratch:
        kimi_dir = write_tiny_model(Path(scratch) / "tiny-kimi-k2", family="kimi-k2")
        for name, directory in ((model_dir.name, model_dir), ("tiny-kimi-k2", kimi_dir)):
            rows = [_run(world, directory, tokens) for world in (1, 2)]
            _print_table(f"Tensor parallel, {name}", rows, tokens)
            results[name] = rows
    return results


if __name__ == "__main__":
    import json
    import sys

    print(json.dumps(run_tensor_parallel_bench(sys.argv[1] if len(sys.argv) > 1 else None, quick=True)))
