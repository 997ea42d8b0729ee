"""What reproducible greedy costs: the engine with batch-invariant steps (the default,
``CACHET_ENGINE_BATCH_INVARIANT``) against the same engine with the faster shape-picked kernels,
same process, same checkpoint and dtype, rounds alternated (A B A B) so drift hits both.

Rows: decode tok/s at 1 and 16 streams (128-token prompts), and time to first token of a cold
~1,800-token prompt (512-token chunks, as the engine runs on a CPU). `python -m
bench.batch_invariance_bench [--quick] [--dtype bfloat16]`; the ``batch_invariance`` section of
``make bench``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from pathlib import Path

import torch
from tokenizers import Tokenizer

from bench.engine_bench import EngineHarness, _prompts
from bench.progress import progress
from cachet.engine.model_runner import default_dtype
from cachet.models.catalog import ensure_model

CPU_CHUNK_TOKENS = 512


def _measure(engine: EngineHarness, tokenizer: Tokenizer, new_tokens: int, long_len: int, seed: int) -> dict:
    row = {}
    for streams in (1, 16):
        for prompt in _prompts(tokenizer, streams, 128, seed=seed + streams):
            engine.submit(prompt, new_tokens)
        generated, seconds = engine.run_until_done()
        row[f"decode_{streams}_tok_s"] = generated / seconds
    engine.reset_cache()
    ttft, _ = engine.time_to_first_token(_prompts(tokenizer, 1, long_len, seed=seed)[0])
    row["cold_ttft_ms"] = ttft * 1000
    return row


def run_batch_invariance_bench(model: str | None = None, dtype: str = "auto", quick: bool = False) -> dict:
    resolved = ensure_model(model, Path(os.environ.get("CACHET_DATA_DIR", "data")))
    torch_dtype = default_dtype(torch.device("cpu")) if dtype == "auto" else getattr(torch, dtype)
    tokenizer = Tokenizer.from_file(str(resolved.path / "tokenizer.json"))
    rounds, new_tokens, long_len = (1, 16, 600) if quick else (2, 64, 1800)
    progress(f"{resolved.model_id}, {torch_dtype}, {torch.get_num_threads()} threads, {rounds} rounds")
    engines = {
        name: EngineHarness(
            resolved.path, resolved.model_id, torch_dtype, CPU_CHUNK_TOKENS, batch_invariant=invariant
        )
        for name, invariant in (("invariant", True), ("fast", False))
    }
    for engine in engines.values():
        engine.submit(_prompts(tokenizer, 1, 32, seed=0)[0], 4)
        engine.run_until_done()
    rows: dict[str, list[dict]] = {name: [] for name in engines}
    for round_ in range(rounds):
        for name in engines if round_ % 2 == 0 else reversed(engines):
            progress(f"round {round_ + 1}: {name}")
            rows[name].append(_measure(engines[name], tokenizer, new_tokens, long_len, seed=round_))
    medians = {
        name: {key: statistics.median(r[key] for r in runs) for key in runs[0]} for name, runs in rows.items()
    }
    result = {
        "model": resolved.model_id,
        "dtype": str(torch_dtype),
        "long_prompt_tokens": long_len,
        **medians,
    }
    _print(result)
    return result


def _print(result: dict) -> None:
    invariant, fast = result["invariant"], result["fast"]
    print(
        f"\nReproducible greedy, {result['model']}, {result['dtype']}: batch-invariant steps against fast ones"
    )
    print(f"{'measure':<34}{'invariant':>12}{'fast':>12}{'ratio':>8}")
    for key, label in (
        ("decode_1_tok_s", "decode tok/s, 1 stream"),
        ("decode_16_tok_s", "decode tok/s, 16 streams"),
        ("cold_ttft_ms", f"cold TTFT ms, {result['long_prompt_tokens']} tokens"),
    ):
        print(f"{label:<34}{invariant[key]:>12.1f}{fast[key]:>12.1f}{invariant[key] / fast[key]:>8.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--model", default=None)
    args = parser.parse_args()
    print(json.dumps(run_batch_invariance_bench(args.model, args.dtype, args.quick), indent=2))


if __name__ == "__main__":
    main()
