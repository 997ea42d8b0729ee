"""Prompt chunks: the CPU prompt kernel against the gather + SDPA path, in fp32 and in bf16 (on
AMX hosts, where the prompt kernel has a bf16 path, and on AVX512-BF16 hosts, where the paged
decode kernel's dot products take every bf16 prompt token).

Two measures, each with its paths in one process, rounds alternated (A B C, C B A) so the
machine's drift falls on all alike, best round kept:

- one layer's attention for a 512-token chunk after 0 to 7,000 cached tokens, the default
  model's heads (9 on 3 KV heads of 64), through ``PagedAttention`` with and without
  ``prefill_kernel`` (the reference gathers the blocks, then SDPA with the causal mask), and
  through the paged decode kernel reading every token, as batch-invariant steps do
  (``every_token_in_place``: reproducible greedy's prompts, and on AVX512-BF16 hosts without
  AMX every bf16 prompt);
- the default model's (or ``--model``'s) cold time to first token at 1,800 / 3,800 / 7,500
  tokens in each dtype, one engine (steps not batch-invariant, as the serving bench runs them) with
  its runner's in-place prompt path on and off: ``prefill_kernel``, or for heads the prompt
  kernel has no tile for (``--model gemma3-270m``) ``prefill_in_place``, the paged decode
  kernel's register tiles.

``python -m bench.prompt_kernel_bench [--model DIR] [--quick]`` or the ``prompt_kernel`` section
of ``make bench``. Skipped where neither kernel takes a prompt (no AVX2 or AVX-512).
"""

from __future__ import annotations

import argparse
import os
import random
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch

from bench.engine_bench import EngineHarness
from bench.progress import progress
from cachet.engine.attention import PagedAttention, SequenceSpan, allocate_kv_cache, build_attention_metadata
from cachet.engine.paged_decode_kernel import prefill_in_place_is_faster
from cachet.engine.prefill_attention_kernel import prefill_kernel_fits
from cachet.models.catalog import ensure_model

HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 9, 3, 64, 16
CHUNK_TOKENS = 512
CACHED_TOKENS = (0, 1024, 3000, 7000)
PROMPT_TOKENS = (1800, 3800, 7500)
QUICK_PROMPT_TOKENS = (1800,)


def _alternated(runs: dict[str, Callable[[], object]], rounds: int) -> dict[str, float]:
    """Best seconds of each callable over ``rounds`` rounds, their order flipped each round."""
    best = dict.fromkeys(runs, float("inf"))
    for round_ in range(rounds):
        for path in sorted(runs, reverse=round_ % 2 == 1):
            started = time.perf_counter()
            runs[path]()
            best[path] = min(best[path], time.perf_counter() - started)
    return best


def _layer_rows(rounds: int, dtype: torch.dtype) -> list[dict]:
    rows = []
    generator = torch.Generator().manual_seed(0)
    for cached in CACHED_TOKENS:
        blocks = -(-(cached + CHUNK_TOKENS) // BLOCK_SIZE)
        cache = allocate_kv_cache(1, blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM, dtype, torch.device("cpu"))[0]
        cache.copy_(torch.randn(cache.shape, generator=generator))
        block_ids = torch.randperm(blocks, generator=generator).tolist()
        q = torch.randn(CHUNK_TOKENS, HEADS, HEAD_DIM, generator=generator).to(dtype)
        k, v = (
            torch.randn(CHUNK_TOKENS, KV_HEADS, HEAD_DIM, generator=generator).to(dtype) for _ in range(2)
        )
        spans = [SequenceSpan(cached, CHUNK_TOKENS, block_ids, sample=True)]
        attention = PagedAttention()
        attention.kv_cache = cache
        cpu = torch.device("cpu")
        metas = {
            "sdpa": build_attention_metadata(spans, BLOCK_SIZE, cpu, decode_in_place=True),
            "invariant": build_attention_metadata(
                spans, BLOCK_SIZE, cpu, decode_in_place=True, every_token_in_place=True
            ),
        }
        if prefill_kernel_fits(dtype, HEAD_DIM, HEADS // KV_HEADS):
            metas["kernel"] = build_attention_metadata(
                spans, BLOCK_SIZE, cpu, decode_in_place=True, prefill_kernel=True
            )
        best = _alternated({path: partial(attention, q, k, v, meta) for path, meta in metas.items()}, rounds)
        row = {
            "dtype": _name(dtype),
            "cached_tokens": cached,
            "kernel_ms": None,  # set below where the prompt kernel has a path for this dtype
            **{f"{path}_ms": seconds * 1000 for path, seconds in best.items()},
        }
        rows.append(row)
        kernel = f"{row['kernel_ms']:.1f}" if row["kernel_ms"] is not None else "-"
        progress(
            f"  {_name(dtype)} 512-token chunk after {cached:,} tokens: SDPA {row['sdpa_ms']:.1f}, kernel {kernel}, "
            f"invariant {row['invariant_ms']:.1f} ms"
        )
    return rows


def _ttft_rows(
    model: str | None, prompt_lengths: tuple[int, ...], rounds: int, dtype: torch.dtype
) -> list[dict]:
    resolved = ensure_model(model, Path(os.environ.get("CACHET_DATA_DIR", "data")))
    engine = EngineHarness(resolved.path, resolved.model_id, dtype, max_batched_tokens=CHUNK_TOKENS)
    runner = engine.runner
    # The in-place path the runner took for this model's prompts: the prompt kernel where it has a
    # tile for the heads, else the paged decode kernel's register tiles (Gemma 3's heads).
    path = (
        "prefill_kernel" if runner.prefill_kernel else "prefill_in_place" if runner.prefill_in_place else None
    )
    if path is None:
        progress(f"  {resolved.model_id}'s prompts attend through SDPA on this CPU: no TTFT rows")
        return []
    rng = random.Random(0)
    rows = []

    def cold(in_place: bool, length: int) -> None:
        setattr(runner, path, in_place)
        engine.reset_cache()
        engine.time_to_first_token([rng.randrange(1_000, 40_000) for _ in range(length)])

    for length in prompt_lengths:
        best = _alternated(
            {"sdpa": partial(cold, False, length), "kernel": partial(cold, True, length)}, rounds
        )
        setattr(runner, path, True)
        rows.append(
            {
                "model": resolved.model_id,
                "dtype": _name(dtype),
                "path": path,
                "prompt_tokens": length,
                "sdpa_s": best["sdpa"],
                "kernel_s": best["kernel"],
            }
        )
        progress(
            f"  {_name(dtype)} cold TTFT, {length:,} tokens ({path}): {best['sdpa']:.2f} -> {best['kernel']:.2f} s"
        )
    return rows


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def run_prompt_kernel_bench(model: str | None = None, quick: bool = False) -> dict:
    dtypes = [
        dtype
        for dtype in (torch.float32, torch.bfloat16)
        if prefill_kernel_fits(dtype, HEAD_DIM, HEADS // KV_HEADS)
        or prefill_in_place_is_faster(dtype, HEAD_DIM)
    ]
    if not dtypes:
        progress("prompt kernel bench skipped: no kernel takes prompt chunks on this CPU")
        return {"skipped": "no kernel takes prompt chunks on this CPU"}
    rounds = 4 if quick else 6
    result: dict = {"layer": [], "cold_ttft": []}
    for dtype in dtypes:
        progress(
            f"{_name(dtype)} prompt chunks, {torch.get_num_threads()} threads: gather + SDPA -> the prompt kernel"
        )
        result["layer"] += _layer_rows(rounds, dtype)
        lengths = QUICK_PROMPT_TOKENS if quick else PROMPT_TOKENS
        result["cold_ttft"] += _ttft_rows(model, lengths, 2 if quick else 3, dtype)
    _print_table(result)
    return result


def _print_table(result: dict) -> None:
    print(
        "\nPrompt chunks: gather + SDPA against the prompt kernel, and the paged decode kernel"
        " that batch-invariant steps use (same process, best round; ratios to SDPA)"
    )
    print(f"{'measure':<62}{'SDPA':>10}{'kernel':>10}{'ratio':>8}{'invariant':>11}{'ratio':>8}")
    print("-" * 109)
    for row in result["layer"]:
        label = f"{row['dtype']}: one layer, 512-token chunk after {row['cached_tokens']:,} (ms)"
        kernel = (
            f"{row['kernel_ms']:>10.2f}{row['kernel_ms'] / row['sdpa_ms']:>8.2f}"
            if row["kernel_ms"] is not None
            else f"{'-':>10}{'-':>8}"
        )
        print(
            f"{label:<62}{row['sdpa_ms']:>10.2f}{kernel}"
            f"{row['invariant_ms']:>11.2f}{row['invariant_ms'] / row['sdpa_ms']:>8.2f}"
        )
    for row in result["cold_ttft"]:
        label = f"{row['dtype']}: {row['model']} cold TTFT, {row['prompt_tokens']:,} tokens (s)"
        print(
            f"{label:<62}{row['sdpa_s']:>10.2f}{row['kernel_s']:>10.2f}{row['kernel_s'] / row['sdpa_s']:>8.2f}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="checkpoint dir or catalog id (default model if unset)")
    parser.add_argument("--quick", action="store_true", help="one TTFT length, fewer rounds")
    args = parser.parse_args()
    run_prompt_kernel_bench(model=args.model, quick=args.quick)


if __name__ == "__main__":
    main()
