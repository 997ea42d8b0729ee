"""Decoding on a checkpoint's own Q4_1 blocks against its plain weights, same process.

A bf16 replica on an AVX512-BF16 CPU multiplies by the default model's Q4_1 blocks for products
of a few rows outside batch-invariant steps, an fp32 replica on an AVX2 CPU for products of a few
rows in any step (``cachet.engine.block_q4_weights``). For each dtype this CPU keeps blocks for,
two engines of the same checkpoint, one keeping the blocks and one not, take turns round by
round (these CPUs drift between runs minutes apart, so only in-run ratios mean anything):

- decode tok/s at 1, 2, 4, 8 and 16 streams (128-token prompts), steps outside batch invariance
  (what sampled requests run);
- time to first token of a 512-token prompt, which the blocks do not run (level expected);
- one step's products of every layer (the head apart) at 1 to 512 rows, on the blocks against
  the panels (bf16: those batch-invariant steps run, and ``all_steps`` would run on the blocks).

`python -m bench.block_q4_bench [--quick]`; the ``block_q4`` section of ``make bench``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer

from bench.engine_bench import EngineHarness, _prompts
from bench.progress import progress
from cachet.engine.block_q4_weights import serves_blocks
from cachet.engine.cpu_kernels import load_cpu_kernel
from cachet.engine.packed_linear import PackableLinear
from cachet.models.catalog import ResolvedModel, ensure_model

STREAMS = (1, 2, 4, 8, 16)
PRODUCT_ROWS = (1, 4, 8, 16, 64, 512)
PROMPT_TOKENS = 128
CPU = torch.device("cpu")


def _measure(engine: EngineHarness, tokenizer: Tokenizer, new_tokens: int, seed: int) -> dict[str, float]:
    row = {}
    for streams in STREAMS:
        for prompt in _prompts(tokenizer, streams, PROMPT_TOKENS, seed=seed + streams):
            engine.submit(prompt, new_tokens)
        generated, seconds = engine.run_until_done()
        row[f"decode_{streams}_tok_s"] = generated / seconds
    engine.reset_cache()
    ttft, _ = engine.time_to_first_token(_prompts(tokenizer, 1, 512, seed=seed)[0])
    row["ttft_512_ms"] = ttft * 1000
    return row


def _products_ms(engine: EngineHarness, dtype: torch.dtype, rows: int, repeats: int) -> dict[str, float]:
    """Best of ``repeats`` of one step's layer products at ``rows`` rows, blocks then panels (bf16:
    the small-batch panels beside oneDNN's weight; fp32: the panels that are the weight)."""
    blocks_kernel, panels_kernel = load_cpu_kernel("block_q4_linear"), load_cpu_kernel("panel_linear")
    assert blocks_kernel is not None and panels_kernel is not None  # serves_blocks saw both build
    fp32 = dtype == torch.float32
    linears = [
        module
        for module in engine.runner.model.modules()
        if isinstance(module, PackableLinear)
        and module.block_q4 is not None
        and (module.panels if fp32 else module.small_batch_panels is not None)
    ]
    inputs = {module.in_features: torch.randn(rows, module.in_features, dtype=dtype) for module in linears}
    on_blocks = blocks_kernel.fp32_linear if fp32 else blocks_kernel.linear
    best = {}
    for name, run in (
        ("blocks", lambda m: on_blocks(inputs[m.in_features], m.block_q4, None)),
        (
            "panels",
            lambda m: panels_kernel.linear(
                inputs[m.in_features], m.weight if fp32 else m.small_batch_panels, None
            ),
        ),
    ):
        times = []
        for _ in range(repeats):
            started = time.perf_counter()
            for module in linears:
                run(module)
            times.append((time.perf_counter() - started) * 1000)
        best[name] = min(times)
    return best


def _compare(
    resolved: ResolvedModel, tokenizer: Tokenizer, dtype: torch.dtype, quick: bool
) -> dict[str, Any]:
    name = str(dtype).removeprefix("torch.")
    rounds, new_tokens = (2, 16) if quick else (4, 48)
    progress(f"block_q4: {resolved.model_id}, {name}, {torch.get_num_threads()} threads, {rounds} rounds")
    engines = {
        label: EngineHarness(resolved.path, resolved.model_id, dtype, 512, block_weights=use)
        for label, use in (("blocks", "small_batches"), ("plain", "off"))
    }
    if engines["blocks"].runner.block_q4_linears == 0:
        progress("block_q4: this checkpoint's weights are no Q4_1 blocks: skipped")
        return {"skipped": True}
    for engine in engines.values():
        engine.submit(_prompts(tokenizer, 1, 32, seed=0)[0], 4)
        engine.run_until_done()
    samples: dict[str, list[dict[str, float]]] = {label: [] for label in engines}
    for round_ in range(rounds):
        for label in engines if round_ % 2 == 0 else reversed(engines):
            progress(f"block_q4: {name}, round {round_ + 1}/{rounds}, {label}")
            samples[label].append(_measure(engines[label], tokenizer, new_tokens, seed=round_))
    medians = {
        label: {key: statistics.median(row[key] for row in rows) for key in rows[0]}
        for label, rows in samples.items()
    }
    progress(f"block_q4: {name}, one step's layer products")
    with torch.inference_mode():
        products = {
            rows: _products_ms(engines["blocks"], dtype, rows, 3 if quick else 7) for rows in PRODUCT_ROWS
        }
    return {
        "rounds": rounds,
        "blocks_linears": engines["blocks"].runner.block_q4_linears,
        "median": medians,
        "layer_products_ms": products,
    }


def run_block_q4_bench(model: str | None = None, quick: bool = False) -> dict[str, Any]:
    """bf16 and fp32 in turn, each where this CPU keeps blocks for it."""
    resolved = ensure_model(model, Path(os.environ.get("CACHET_DATA_DIR", "data")))
    tokenizer = Tokenizer.from_file(str(resolved.path / "tokenizer.json"))
    result: dict[str, Any] = {"model": resolved.model_id, "threads": torch.get_num_threads(), "dtypes": {}}
    for dtype in (torch.bfloat16, torch.float32):
        name = str(dtype).removeprefix("torch.")
        if not serves_blocks(CPU, dtype):
            progress(f"block_q4: {name} replicas keep no blocks on this CPU: skipped")
            continue
        result["dtypes"][name] = compared = _compare(resolved, tokenizer, dtype, quick)
        if not compared.get("skipped"):
            _print(result, name)
    return result


def _print(result: dict[str, Any], dtype: str) -> None:
    compared = result["dtypes"][dtype]
    blocks, plain = compared["median"]["blocks"], compared["median"]["plain"]
    print(f"\nQ4_1 blocks against {dtype} weights ({result['model']}, {result['threads']} threads, medians)")
    header = f"{'measure':<26}{dtype:>10}{'blocks':>10}{'ratio':>9}"
    print(header)
    print("-" * len(header))
    for key in plain:
        print(f"{key:<26}{plain[key]:>10.1f}{blocks[key]:>10.1f}{blocks[key] / plain[key]:>8.2f}x")
    print(f"\nOne step's layer products (best ms), blocks against the {dtype} panels")
    header = f"{'rows':<26}{'panels':>10}{'blocks':>10}{'ratio':>9}"
    print(header)
    print("-" * len(header))
    for rows, times in compared["layer_products_ms"].items():
        print(
            f"{rows:<26}{times['panels']:>10.2f}{times['blocks']:>10.2f}{times['blocks'] / times['panels']:>8.2f}x"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--model", default=None)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    result = run_block_q4_bench(model=args.model, quick=args.quick)
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
