"""Decode after long prompts: the CPU paged decode kernel against the gather + SDPA path.

Two engines on the same checkpoint in one process, one reading the KV cache in place
(``cachet.engine.paged_decode_kernel``), one gathering it for SDPA (the reference path),
timed in alternating rounds so the machine's drift falls on both alike. Each row times
decode only: every stream has its first token before the clock starts.

``python -m bench.decode_kernel_bench [--model DIR] [--dtype auto|float32|bfloat16] [--quick]``
or the ``decode_kernel`` section of ``make bench``.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch
from tokenizers import Tokenizer

from bench.engine_bench import EngineHarness, _prompts
from bench.progress import progress
from cachet.engine.model_runner import default_dtype
from cachet.engine.paged_decode_kernel import load_paged_decode_kernel
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
    results = {"model": resolved.model_id, "dtype": str(torch_dtype), "rows": rows}
    _print_table(results)
    return results


def _print_table(results: dict) -> None:
    print(f"\nDecode kernel: {results['model']}, {results['dtype']} (decode tok/s, best of rounds)")
    print(f"{'streams':>8}{'context':>9}{'in place':>11}{'gather':>10}{'ratio':>8}")
    for row in results["rows"]:
        print(
            f"{row['streams']:>8}{row['context']:>9}{row['in_place']:>11.1f}{row['gather']:>10.1f}"
            f"{row['ratio']:>8.2f}"
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
