"""Decode after long prompts: the CPU paged decode kernel against the gather + SDPA path.

Two engines on the same checkpoint in one process, one reading the KV cache in place
(``cachet.engine.paged_decode_kernel``), one gathering it for SDPA (the reference path),
timed in alternating rounds so the machine's drift falls on both alike. Each row times
decode only: every stream has its first token before the clock starts.

Then the kernel alone over a pool's two layouts, in alternating rounds: a fresh pool hands a
request consecutive blocks; a pool in use hands them out one by one from its free list, in the
order they were freed, and decodes that grow side by side take turns at it, so a request's
blocks lie scattered. Each row is one step's attention over the model's layers, with a step's
worth of weights read between layers as the products read them (the KV comes from memory, as
in a step).

``python -m bench.decode_kernel_bench [--model DIR] [--dtype auto|float32|bfloat16] [--quick]``
or the ``decode_kernel`` section of ``make bench``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import torch
from tokenizers import Tokenizer

from bench.engine_bench import EngineHarness, _prompts
from bench.progress import progress
from cachet.engine.model_runner import ModelRunner, default_dtype
from cachet.engine.paged_decode_kernel import load_paged_decode_kernel, paged_decode_attention
from cachet.models.catalog import ensure_model

# (streams, prompt tokens): the serving bench's decode-vs-context points, and a batch.
SCENARIOS = [(1, 100), (1, 1000), (1, 3800), (1, 7500), (16, 1000)]
QUICK_SCENARIOS = [(1, 100), (1, 3800), (16, 1000)]


def _decode_tokens_per_second(engine: EngineHarness, prompts: list[list[int]], new_tokens: int) -> float:
    ids = [engine.submit(prompt, new_tokens + 1) for prompt in prompts]
    started = set()
    while len(started) < len(ids):
        started.update(o.request_id for o in engine._step() if o.new_token_ids)
    generated, seconds = engine.run_until_done()
    return generated / seconds


def run_decode_kernel_bench(
    model: str | None = None, dtype: str = "auto", quick: bool = False, rounds: int = 2
) -> dict:
    if load_paged_decode_kernel() is None:
        progress("decode kernel bench skipped: the paged decode kernel did not build")
        return {"skipped": "the paged decode kernel did not build"}
    resolved = ensure_model(model, Path(os.environ.get("CACHET_DATA_DIR", "data")))
    torch_dtype = default_dtype(torch.device("cpu")) if dtype == "auto" else getattr(torch, dtype)
    tokenizer = Tokenizer.from_file(str(resolved.path / "tokenizer.json"))
    new_tokens = 16 if quick else 32
    progress(f"model {resolved.model_id}, {torch_dtype}, {torch.get_num_threads()} threads")
    engines = {
        path: EngineHarness(
            resolved.path,
            resolved.model_id,
            torch_dtype,
            max_batched_tokens=512,
            paged_decode_kernel=path == "in place",
            kv_cache_gib=2.0,
        )
        for path in ("in place", "gather")
    }
    rows = []
    for streams, length in QUICK_SCENARIOS if quick else SCENARIOS:
        best: dict[str, float] = {}
        for round_index in range(rounds):
            for path, engine in engines.items():
                progress(f"{streams} stream(s) after {length} tokens, {path}, round {round_index + 1}")
                engine.reset_cache()
                prompts = _prompts(tokenizer, streams, length, seed=length + round_index)
                rate = _decode_tokens_per_second(engine, prompts, new_tokens)
                best[path] = max(best.get(path, 0.0), rate)
        rows.append(
            {
                "streams": streams,
                "context": length,
                "in_place": best["in place"],
                "gather": best["gather"],
                "ratio": best["in place"] / best["gather"],
            }
        )
    layout_rows = _pool_layout_rows(engines["in place"].runner, quick=quick)
    results = {
        "model": resolved.model_id,
        "dtype": str(torch_dtype),
        "rows": rows,
        "pool_layout": layout_rows,
    }
    _print_table(results)
    return results


# (label, keys per decode): a decode replica's few streams beside one long prompt, and a batch.
LAYOUT_SCENARIOS = [
    ("4 decodes, one after a long prompt", [150, 150, 150, 1850]),
    ("16 decodes", [1000] * 16),
]


def _pool_layout_rows(runner: ModelRunner, quick: bool) -> list[dict]:
    """ms of decode attention a step, consecutive blocks against scattered ones."""
    kv_cache = runner.kv_cache
    if kv_cache.dim() != 6:
        return []  # a model that caches its own per-token layout (MLA): not this kernel's
    layers, _, num_blocks, block_size, _, head_dim = kv_cache.shape
    heads = runner.config.num_attention_heads
    generator = torch.Generator().manual_seed(0)
    # A step's weights, streamed between layers as the products stream them (what evicts the KV).
    weight_bytes = sum(p.numel() * p.element_size() for p in runner.model.parameters())
    weights = torch.empty(layers, max(weight_bytes // layers // 4, 1), dtype=torch.float32).fill_(1.0)
    # Random KV, so no value is special; the pool's content is not the engine's concern here.
    kv_cache.normal_(generator=generator)
    rows = []
    for label, lens in LAYOUT_SCENARIOS:
        needed = [-(-n // block_size) for n in lens]
        if sum(needed) > num_blocks:
            continue
        q = torch.randn(len(lens), heads, head_dim, generator=generator).to(kv_cache.dtype)
        seq_lens = torch.tensor(lens, dtype=torch.int64)
        tables = {
            "consecutive": torch.arange(num_blocks),
            # One by one in no order of their own: a used pool's free list, at its worst.
            "scattered": torch.randperm(num_blocks, generator=generator),
        }
        timings: dict[str, list[float]] = {name: [] for name in tables}
        for round_index in range(2 if quick else 6):
            names = list(tables) if round_index % 2 == 0 else list(tables)[::-1]
            for name in names:
                progress(f"pool layout: {label}, {name} blocks, round {round_index + 1}")
                table = _block_table(tables[name], needed)
                timings[name].append(
                    _attention_step_seconds(kv_cache, weights, q, table, seq_lens, head_dim**-0.5)
                )
        consecutive, scattered = (statistics.median(timings[name]) for name in tables)
        rows.append(
            {
                "scenario": label,
                "consecutive_ms": consecutive * 1e3,
                "scattered_ms": scattered * 1e3,
                "ratio": scattered / consecutive,
            }
        )
    kv_cache.zero_()  # as the runner allocates it: padded gathers read unused slots
    return rows


def _block_table(order: torch.Tensor, needed: list[int]) -> torch.Tensor:
    table = torch.zeros(len(needed), max(needed), dtype=torch.int64)
    start = 0
    for row, count in enumerate(needed):
        table[row, :count] = order[start : start + count]
        start += count
    return table


def _attention_step_seconds(
    kv_cache: torch.Tensor,
    weights: torch.Tensor,
    q: torch.Tensor,
    table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> float:
    """Median over a few steps of the kernel's time over every layer (the weights' reads apart)."""
    steps = []
    for _ in range(6):
        seconds = 0.0
        for layer in range(kv_cache.shape[0]):
            weights[layer].max()
            started = time.perf_counter()
            paged_decode_attention(q, kv_cache[layer, 0], kv_cache[layer, 1], table, seq_lens, scale)
            seconds += time.perf_counter() - started
        steps.append(seconds)
    return statistics.median(steps[1:])


def _print_table(results: dict) -> None:
    print(f"\nDecode kernel: {results['model']}, {results['dtype']} (decode tok/s, best of rounds)")
    print(f"{'streams':>8}{'context':>9}{'in place':>11}{'gather':>10}{'ratio':>8}")
    for row in results["rows"]:
        print(
            f"{row['streams']:>8}{row['context']:>9}{row['in_place']:>11.1f}{row['gather']:>10.1f}"
            f"{row['ratio']:>8.2f}"
        )
    print("\nDecode attention over a pool's layouts (ms a step, every layer; median of rounds)")
    print(f"{'scenario':<40}{'consecutive':>13}{'scattered':>11}{'ratio':>8}")
    for row in results["pool_layout"]:
        print(
            f"{row['scenario']:<40}{row['consecutive_ms']:>13.2f}{row['scattered_ms']:>11.2f}{row['ratio']:>8.2f}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    started = time.perf_counter()
    run_decode_kernel_bench(model=args.model, dtype=args.dtype, quick=args.quick)
    progress(f"done in {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
