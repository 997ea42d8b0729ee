"""Steps with and without CUDA graphs, same process, same GPU (skipped without one).

The engine runs synchronously (no gRPC) twice over one checkpoint: eager steps, then steps
replayed from CUDA graphs (decodes whole, ``cachet.engine.cuda_graphs``; steps holding prompt
tokens between attention calls, ``cachet.engine.piecewise_graphs``). The decode rows time
decode only: every request has its first token before the clock starts, so prefill is not in
the rate. The prompt-step rows time steps that each take a new prompt (and the streams'
decodes beside it), as an engine under arrivals runs them.
`python -m bench.cuda_graph_bench [--model DIR]`.
"""

from __future__ import annotations

import argparse
import gc
import os
import time
from pathlib import Path

import torch

from bench.engine_bench import EngineHarness
from bench.progress import progress
from cachet.engine_layout import GPU_MAX_NUM_BATCHED_TOKENS
from cachet.models.catalog import ensure_model

STREAMS = (1, 16, 64)
CONTEXTS = (100, 2000)
# (decoding streams, prompt tokens each step): arrivals beside decodes, and a prompt alone.
PROMPT_STEPS = ((16, 64), (64, 256), (0, 1024))
TIMED_PROMPT_STEPS = 40
KV_CACHE_GIB = 16.0


def _decode_tokens_per_second(harness: EngineHarness, streams: int, context: int, new_tokens: int) -> float:
    vocab = harness.runner.vocab_size
    generator = torch.Generator().manual_seed(streams * 7919 + context)
    for _ in range(streams):
        harness.submit(torch.randint(0, vocab, (context,), generator=generator).tolist(), new_tokens)
    started: set[str] = set()
    while len(started) < streams:
        started.update(o.request_id for o in harness.core.step() if o.new_token_ids)
    torch.cuda.synchronize()
    generated, start = 0, time.perf_counter()
    while harness.core.has_unfinished_requests():
        generated += sum(len(o.new_token_ids) for o in harness.core.step())
    return generated / (time.perf_counter() - start)


def _prompt_step_ms(harness: EngineHarness, streams: int, prompt_tokens: int, steps: int) -> float:
    """Mean time of ``steps`` steps that each start a new ``prompt_tokens``-token prompt (one
    output token) beside ``streams`` decoding requests."""
    vocab = harness.runner.vocab_size
    generator = torch.Generator().manual_seed(streams * 31 + prompt_tokens)

    def tokens(count: int) -> list[int]:
        return torch.randint(0, vocab, (count,), generator=generator).tolist()

    for _ in range(streams):
        harness.submit(tokens(100), steps + 64)
    started: set[str] = set()
    while len(started) < streams:
        started.update(o.request_id for o in harness.core.step() if o.new_token_ids)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        harness.submit(tokens(prompt_tokens), 1)
        harness.core.step()
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    while harness.core.has_unfinished_requests():
        harness.core.step()
    return elapsed / steps * 1000


def run_cuda_graph_bench(model: str | None = None, dtype: str = "auto", quick: bool = False) -> dict:
    if not torch.cuda.is_available():
        print("\nCUDA graphs: skipped (no CUDA device)")
        return {"skipped": "no CUDA device"}
    resolved = ensure_model(model, Path(os.environ.get("CACHET_DATA_DIR", "data")))
    torch_dtype = torch.bfloat16 if dtype == "auto" else getattr(torch, dtype)
    new_tokens = 32 if quick else 128
    device_name = torch.cuda.get_device_name()
    progress(f"model {resolved.model_id}, {torch_dtype}, {device_name}, {new_tokens} new tokens per stream")
    rates: dict[str, dict[str, float]] = {}
    prompt_steps: dict[str, dict[str, float]] = {}
    capture_seconds = 0.0
    for mode in ("eager", "graphs"):
        progress(f"loading the engine ({mode})")
        start = time.perf_counter()
        harness = EngineHarness(
            resolved.path,
            resolved.model_id,
            torch_dtype,
            max_batched_tokens=GPU_MAX_NUM_BATCHED_TOKENS,
            max_num_seqs=max(STREAMS),
            device="cuda",
            cuda_graphs=mode == "graphs",
            # Every stream's whole context at once: a smaller pool preempts, and then the
            # rows time recomputed prefills, not decoding.
            kv_cache_gib=KV_CACHE_GIB,
        )
        if mode == "graphs":
            capture_seconds = time.perf_counter() - start
        _decode_tokens_per_second(harness, 1, 16, 4)  # warm-up: kernels, allocator
        for streams in STREAMS:
            for context in CONTEXTS:
                progress(f"{mode}: {streams} streams after {context}-token prompts")
                rate = _decode_tokens_per_second(harness, streams, context, new_tokens)
                rates.setdefault(f"{streams} streams, {context}-token context", {})[mode] = rate
        for streams, prompt_tokens in PROMPT_STEPS:
            progress(f"{mode}: a {prompt_tokens}-token prompt each step beside {streams} streams")
            step_ms = _prompt_step_ms(harness, streams, prompt_tokens, TIMED_PROMPT_STEPS)
            name = f"{prompt_tokens}-token prompt + {streams} decodes"
            prompt_steps.setdefault(name, {})[mode] = step_ms
        del harness
        gc.collect()
        torch.cuda.empty_cache()
    results = {
        "model": resolved.model_id,
        "dtype": str(torch_dtype),
        "device": device_name,
        "load_with_capture_seconds": capture_seconds,
        "decode_tokens_per_second": rates,
        "prompt_step_ms": prompt_steps,
    }
    _print_table(results)
    return results


def _print_table(results: dict) -> None:
    print(f"\nCUDA graphs: {results['model']}, {results['dtype']}, {results['device']}")
    print(f"{'decode tok/s':<36}{'eager':>10}{'graphs':>10}{'ratio':>8}")
    print("-" * 64)
    for name, rate in results["decode_tokens_per_second"].items():
        print(
            f"{name:<36}{rate['eager']:>10.1f}{rate['graphs']:>10.1f}{rate['graphs'] / rate['eager']:>8.2f}"
        )
    print(f"{'step ms, a new prompt each step':<36}{'eager':>10}{'graphs':>10}{'speedup':>8}")
    print("-" * 64)
    for name, ms in results["prompt_step_ms"].items():
        print(f"{name:<36}{ms['eager']:>10.2f}{ms['graphs']:>10.2f}{ms['eager'] / ms['graphs']:>8.2f}")
    print(f"load with graph capture: {results['load_with_capture_seconds']:.1f} s")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=None, help="model id or checkpoint dir")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    run_cuda_graph_bench(args.model, args.dtype, args.quick)
