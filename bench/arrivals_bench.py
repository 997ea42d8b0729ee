"""The engine's own trade between a backlog's drain and interactive time to first token.

The queue bench runs every service as a process on loopback; on a 2-core machine what it
measures mixes the engine with the router's and the gRPC hops' share of the cores. This
one drives an ``EngineCore`` in this process, no gRPC, on the tiny model, so the numbers
are the scheduler's and the model's alone. For each setting of arrivals between layers
(``EngineCore.step``'s ``arrivals``), in turn, three windows:

1. **capacity**: a backlog of batch requests alone, the batch seat limit full;
2. **interactive alone**: interactive requests, evenly spaced at ``INTERACTIVE_SHARE`` of
   that capacity, nothing else; time to first token from the arrival's due time;
3. **mixed**: the same arrivals beside the backlog. Share of free capacity = batch
   requests/s / (capacity - interactive requests/s), the queue bench's measure.

Every request is ``PROMPT_TOKENS`` random token ids and ``MAX_TOKENS`` greedy tokens, as
in the queue bench. Arrivals are admitted as the engine's loop would: before each step,
and between layers when the setting is on.
"""

from __future__ import annotations

import os
import random
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from bench.engine_bench import EngineHarness, one_math_thread
from bench.queue_bench import (
    INTERACTIVE_SHARE,
    MAX_NUM_SEQS,
    MAX_TOKENS,
    PROMPT_TOKENS,
    TOKEN_RANGE,
    _percentile,
)
from cachet.config import EngineSettings
from cachet.engine.model_runner import default_dtype
from cachet.engine.request import Request
from cachet.engine.request_output import RequestOutput
from cachet.engine.sampling_params import SamplingParams
from cachet.models.catalog import ensure_model
from cachet.models.tiny import write_tiny_model

WAITING_BATCH = 8  # batch requests kept waiting, so the backlog never runs dry


class _Window:
    """One window's requests on a fresh ``EngineCore``."""

    def __init__(self, harness: EngineHarness, rng: random.Random, interleave: bool) -> None:
        harness.reset_cache()
        self.core = harness.core
        self.rng = rng
        self.interleave = interleave
        self.ids = 0
        self.due: dict[str, float] = {}  # interactive request -> when it was due
        self.ttft_ms: list[float] = []
        self.tokens = {"batch": 0, "interactive": 0}

    def add(self, interactive: bool) -> str:
        self.ids += 1
        request_id = f"{'i' if interactive else 'b'}{self.ids}"
        prompt = [self.rng.randrange(*TOKEN_RANGE) for _ in range(PROMPT_TOKENS)]
        sampling = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
        self.core.add_request(
            Request(request_id, prompt, sampling, max_tokens=MAX_TOKENS, interactive=interactive)
        )
        return request_id

    def count(self, outputs: list[RequestOutput] | None) -> None:
        for output in outputs or ():
            due = self.due.pop(output.request_id, None)
            if due is not None and output.new_token_ids:
                self.ttft_ms.append((time.perf_counter() - due) * 1000)
            kind = "interactive" if output.request_id.startswith("i") else "batch"
            self.tokens[kind] += len(output.new_token_ids)

    def run(self, seconds: float, rate: float, backlog: bool) -> dict[str, Any]:
        started = time.perf_counter()
        next_due = started

        def admit_arrivals() -> None:
            nonlocal next_due
            while rate and time.perf_counter() >= next_due:
                self.due[self.add(True)] = next_due
                next_due += 1 / rate

        def between_layers() -> None:
            admit_arrivals()
            self.count(self.core.step_arrivals())

        arrivals: Callable[[], None] | None = between_layers if self.interleave else None
        while time.perf_counter() - started < seconds:
            while backlog and len(self.core.scheduler.waiting) < WAITING_BATCH:
                self.add(False)
            admit_arrivals()
            self.count(self.core.step(arrivals))
        elapsed = time.perf_counter() - started
        ordered = sorted(self.ttft_ms)
        return {
            "batch_requests_per_s": self.tokens["batch"] / MAX_TOKENS / elapsed,
            "interactive_requests_per_s": self.tokens["interactive"] / MAX_TOKENS / elapsed,
            "ttft_p50_ms": statistics.median(ordered) if ordered else 0.0,
            "ttft_p99_ms": _percentile(ordered, 0.99) if ordered else 0.0,
        }


def _setting(harness: EngineHarness, interleave: bool, seconds: float, seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    capacity = _Window(harness, rng, interleave).run(seconds, 0.0, backlog=True)["batch_requests_per_s"]
    rate = INTERACTIVE_SHARE * capacity
    alone = _Window(harness, rng, interleave).run(seconds, rate, backlog=False)
    mixed = _Window(harness, rng, interleave).run(seconds, rate, backlog=True)
    free = capacity - mixed["interactive_requests_per_s"]
    return {
        "capacity_requests_per_s": capacity,
        "interactive_rate_per_s": rate,
        "alone": alone,
        "mixed": mixed,
        "free_capacity_share": mixed["batch_requests_per_s"] / free if free > 0 else 0.0,
        "ttft_p50_ratio": mixed["ttft_p50_ms"] / alone["ttft_p50_ms"],
        "ttft_p99_ratio": mixed["ttft_p99_ms"] / alone["ttft_p99_ms"],
    }


def run_arrivals_bench(quick: bool = False, model: str | None = None) -> dict[str, Any]:
    """On the tiny model by default; ``model`` (an id or checkpoint dir) runs a real one, whose
    steps are bound by its matrix products rather than by the cost of launching its operators,
    the regime a pass of an arrival's own costs least in. Its windows are longer (a real
    model on a CPU runs a few requests a second)."""
    model_name = model or "tiny model"
    print(f"[bench] engine arrivals trade (one process, {model_name}, no gRPC)", flush=True)
    seconds = (3.0 if quick else 8.0) if model is None else (10.0 if quick else 30.0)
    rounds = 1 if quick else 2
    with one_math_thread(), tempfile.TemporaryDirectory(prefix="cachet-arrivals-bench-") as directory:
        if model is None:
            model_dir, model_id = write_tiny_model(Path(directory) / "tiny"), "tiny"
        else:
            resolved = ensure_model(model, Path(os.environ.get("CACHET_DATA_DIR", "data")))
            model_dir, model_id = resolved.path, resolved.model_id
        # What `python -m cachet.engine` runs with on this machine: its default dtype here (bf16
        # on a CPU with native bf16, where a 24-row step of the tiny model's head is 3.5x
        # faster than in fp32), its step token budget and its seat limit for batch work.
        settings = EngineSettings(max_num_seqs=MAX_NUM_SEQS)
        dtype = default_dtype(torch.device("cpu"))
        harness = EngineHarness(
            model_dir,
            model_id,
            dtype,
            max_batched_tokens=settings.max_num_batched_tokens,
            max_num_seqs=MAX_NUM_SEQS,
            max_batch_running=settings.max_batch_running,
        )
        runs: dict[str, list[dict[str, Any]]] = {"on": [], "off": []}
        # Alternated, so a slow spell of a shared machine falls on both settings.
        for round_index in range(rounds):
            for name in ("on", "off"):
                print(
                    f"[bench]   round {round_index + 1}/{rounds}, arrivals between layers {name}", flush=True
                )
                runs[name].append(_setting(harness, name == "on", seconds, seed=round_index))
    setup = f"{model_id}, {str(dtype).removeprefix('torch.')}, {settings.max_num_batched_tokens}-token steps"
    _print(runs, setup)
    return {"window_s": seconds, "model": model_id, "dtype": str(dtype), "runs": runs}


def _print(runs: dict[str, list[dict[str, Any]]], setup: str) -> None:
    print(f"\nEngine alone: backlog drain against interactive TTFT (one process, {setup})")
    header = (
        f"{'between layers':<16}{'capacity/s':>11}{'share drained':>15}"
        f"{'TTFT p50 alone/mixed (ms)':>28}{'ratio':>7}{'p99 ratio':>11}"
    )
    print(header)
    print("-" * len(header))
    for name, results in runs.items():
        for result in results:
            alone, mixed = result["alone"], result["mixed"]
            print(
                f"{name:<16}{result['capacity_requests_per_s']:>11.1f}{result['free_capacity_share']:>15.2f}"
                f"{alone['ttft_p50_ms']:>15.1f} /{mixed['ttft_p50_ms']:>10.1f}"
                f"{result['ttft_p50_ratio']:>7.2f}{result['ttft_p99_ratio']:>11.2f}"
            )


if __name__ == "__main__":
    run_arrivals_bench()
