"""Forward passes on linear weights packed for oneDNN against plain ones, same process.

The engine packs a CPU model's linear weights once after loading
(``cachet.engine.packed_linear``). Two runners of the same checkpoint, one packed and
one plain, take turns on each shape (these CPUs drift between runs minutes apart, so
only in-run ratios mean anything):

- a one-token prompt: a pass's fixed cost, what an interactive arrival's pass of its
  own costs a backlog's step;
- a 40-token prompt: the queue bench's requests, the arrival's whole pass;
- a decode step of 23 rows: the backlog's steady step at the batch seat limit;
- a 512-token prefill step: the engine's step token budget, all prompt.
"""

from __future__ import annotations

import os
import random
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from bench.engine_bench import EngineHarness, one_math_thread
from bench.queue_bench import TOKEN_RANGE
from cachet.engine.model_runner import default_dtype
from cachet.engine.packed_linear import packs_linear_weights
from cachet.models.catalog import ensure_model

DECODE_ROWS = 23
DECODE_LABEL = f"decode step, {DECODE_ROWS} rows"
# (label, prompts of this many tokens in one step)
PREFILL_SHAPES = (("one-token prompt", [1]), ("40-token prompt", [40]), ("512-token prefill step", [64] * 8))


def _prompt(rng: random.Random, tokens: int) -> list[int]:
    return [rng.randrange(*TOKEN_RANGE) for _ in range(tokens)]


def _prefill_ms(harness: EngineHarness, rng: random.Random, prompts: list[int]) -> float:
    """One step that carries exactly these prompts (a fresh cache: nothing of them is cached)."""
    harness.reset_cache()
    for tokens in prompts:
        harness.submit(_prompt(rng, tokens), max_tokens=2)
    started = time.perf_counter()
    harness.core.step()
    return (time.perf_counter() - started) * 1000


def _decode_ms(harness: EngineHarness, rng: random.Random, steps: int) -> list[float]:
    harness.reset_cache()
    for _ in range(DECODE_ROWS):
        harness.submit(_prompt(rng, 40), max_tokens=steps + 8)
    scheduler = harness.core.scheduler
    while scheduler.waiting or not all(request.output_token_ids for request in scheduler.running):
        harness.core.step()
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        harness.core.step()
        times.append((time.perf_counter() - started) * 1000)
    return times


def run_linear_packing_bench(model: str | None = None, quick: bool = False) -> dict[str, Any]:
    """The default model unless ``model`` names one; its default dtype on this CPU."""
    resolved = ensure_model(model, Path(os.environ.get("CACHET_DATA_DIR", "data")))
    dtype = default_dtype(torch.device("cpu"))
    print(f"[bench] linear weights packed for oneDNN vs plain ({resolved.model_id}, {dtype})", flush=True)
    if not packs_linear_weights(torch.device("cpu"), dtype):
        print("[bench]   this CPU or torch build cannot pack these weights: skipped", flush=True)
        return {"model": resolved.model_id, "dtype": str(dtype), "skipped": True}
    rounds = 3 if quick else 7
    with one_math_thread():
        harnesses = {
            name: EngineHarness(
                resolved.path, resolved.model_id, dtype, max_batched_tokens=512, pack_weights=name == "packed"
            )
            for name in ("plain", "packed")
        }
        rows = _median_ms(harnesses, rounds)
    _print(rows, resolved.model_id, str(dtype).removeprefix("torch."))
    return {"model": resolved.model_id, "dtype": str(dtype), "rounds": rounds, "median_ms": rows}


def _median_ms(harnesses: dict[str, EngineHarness], rounds: int) -> dict[str, dict[str, float]]:
    """Step label -> harness name -> median ms over ``rounds``, after one warm-up round (oneDNN
    picks and caches its kernels per shape)."""
    rng = random.Random(0)
    labels = [label for label, _ in PREFILL_SHAPES] + [DECODE_LABEL]
    samples: dict[str, dict[str, list[float]]] = {label: {name: [] for name in harnesses} for label in labels}
    for round_index in range(rounds + 1):
        print(f"[bench]   round {round_index}/{rounds}{' (warm-up)' if round_index == 0 else ''}", flush=True)
        # Alternated shape by shape, so a slow spell of a shared machine falls on both.
        warm_up = round_index == 0
        for label, prompts in PREFILL_SHAPES:
            for name, harness in harnesses.items():
                elapsed = _prefill_ms(harness, rng, prompts)
                if not warm_up:
                    samples[label][name].append(elapsed)
        for name, harness in harnesses.items():
            decode_steps = _decode_ms(harness, rng, steps=4)
            if not warm_up:
                samples[DECODE_LABEL][name].extend(decode_steps)
    return {
        label: {name: statistics.median(times) for name, times in by_name.items()}
        for label, by_name in samples.items()
    }


def _print(rows: dict[str, dict[str, float]], model_id: str, dtype: str) -> None:
    print(f"\nLinear weights packed for oneDNN ({model_id}, {dtype}, one thread; median ms per step)")
    header = f"{'step':<28}{'plain':>10}{'packed':>10}{'speedup':>10}"
    print(header)
    print("-" * len(header))
    for label, by_name in rows.items():
        plain, packed = by_name["plain"], by_name["packed"]
        print(f"{label:<28}{plain:>10.1f}{packed:>10.1f}{plain / packed:>9.2f}x")


if __name__ == "__main__":
    run_linear_packing_bench()
