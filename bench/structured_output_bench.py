"""Structured-output benchmark: decode throughput with a JSON schema vs without, and compile times.

- decode tokens/s on the default model at 1 and 8 concurrent streams, free text vs constrained
  by a JSON schema (target: constrained >= 0.9x free). Both sides decode the same work: each
  constrained stream stops when its document is complete, so every free stream decodes exactly
  the token count its constrained twin wrote (``ignore_eos``; seeded streams write the same
  documents every time). Otherwise the constrained batch thins out as documents finish (a mean
  batch of ~6 of 8 measured) while the free one stays full, and the ratio measures batch size,
  not the grammar. The last column keeps that former comparison (free streams to max_tokens).
- The two sides run side by side, one step of each in turn on two engines (alternating which goes
  first), each step timed alone: the CPUs this runs on are shared, and load swings 2x within a
  minute, so runs one after the other compare the load, not the grammar.
- compile + first-matcher time per schema of the test set (tests/engine/test_structured_output_schemas.py),
  each with an empty cache, and the same again from the cache.
"""

from __future__ import annotations

import importlib.util
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer

from bench.progress import progress
from cachet.common.v1 import common_pb2
from cachet.engine.engine_core import EngineCore
from cachet.engine.grammar_matcher import RequestGrammar
from cachet.engine.model_runner import ModelRunner, default_dtype
from cachet.engine.request import Request
from cachet.engine.sampling_params import SamplingParams
from cachet.engine.scheduler import SchedulerConfig
from cachet.engine.structured_output import GrammarCompiler, GrammarSpec, grammar_spec_from_proto
from cachet.models.catalog import ensure_model

_SCHEMAS_FILE = Path(__file__).resolve().parents[1] / "tests/engine/test_structured_output_schemas.py"
# A schema whose documents run long enough (~60-100 tokens) for a steady decode rate.
_BENCH_SCHEMA = "order_refs"


def load_schemas() -> dict[str, dict]:
    """The test set, loaded by path: tests/ is not a package."""
    spec = importlib.util.spec_from_file_location("structured_output_schemas", _SCHEMAS_FILE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.SCHEMAS


def schema_spec(schema: dict) -> GrammarSpec:
    fmt = common_pb2.ResponseFormat(json_schema=common_pb2.JsonSchemaFormat(schema_json=json.dumps(schema)))
    spec = grammar_spec_from_proto(fmt)
    assert spec is not None
    return spec


def compile_times(tokenizer: Tokenizer, vocab_size: int, eos: list[int]) -> dict[str, dict[str, float]]:
    """ms per schema: cold (compile + validate + build a matcher) and cached (matcher only)."""
    compiler = GrammarCompiler(tokenizer, vocab_size, eos)
    times: dict[str, dict[str, float]] = {}
    for name, schema in load_schemas().items():
        spec = schema_spec(schema)
        start = time.perf_counter()
        compiler.new_matcher(spec).result()
        cold = time.perf_counter() - start
        start = time.perf_counter()
        compiler.new_matcher(spec).result()
        times[name] = {"cold_ms": cold * 1e3, "cached_ms": (time.perf_counter() - start) * 1e3}
    compiler.shutdown()
    return times


@dataclass
class DecodeRun:
    """Streams decoded to the end on one engine, with the time spent in its steps."""

    request_ids: list[str]
    tokens_per_stream: list[int]
    seconds: float = 0.0
    steps: int = 0

    @property
    def tokens(self) -> int:
        return sum(self.tokens_per_stream)

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds


def add_streams(core: EngineCore, compiler: GrammarCompiler | None, lengths: list[int]) -> DecodeRun:
    """One stream per entry of ``lengths`` (its max_tokens), seeded at temperature 0.7.

    With ``compiler`` the streams follow the bench schema and stop when their document is done;
    without, they ignore EOS and run to exactly their length.
    """
    spec = schema_spec(load_schemas()[_BENCH_SCHEMA])
    run = DecodeRun([], [0] * len(lengths))
    for i, max_tokens in enumerate(lengths):
        grammar = RequestGrammar.create(compiler, spec) if compiler is not None else None
        prompt = [1, *range(1000 + 7 * i, 1032 + 7 * i)]
        params = SamplingParams(temperature=0.7, seed=i, ignore_eos=compiler is None)
        run.request_ids.append(f"r{time.monotonic_ns()}-{i}")
        core.add_request(Request(run.request_ids[-1], prompt, params, max_tokens, grammar=grammar))
    while any(r.grammar is not None and not r.grammar.ready for r in core.scheduler.waiting):
        time.sleep(0.001)  # compiles are not what this measures
    return run


def step_timed(core: EngineCore, run: DecodeRun) -> None:
    start = time.perf_counter()
    outputs = core.step()
    run.seconds += time.perf_counter() - start
    run.steps += 1
    for output in outputs:
        run.tokens_per_stream[run.request_ids.index(output.request_id)] += len(output.new_token_ids)


def side_by_side(
    schema_core: EngineCore, free_core: EngineCore, max_tokens: int, free_lengths: list[int]
) -> tuple[DecodeRun, DecodeRun]:
    """Constrained streams (to max_tokens) and free streams (to ``free_lengths``), a step of each in turn.

    Either engine can take either side: both have a grammar compiler, as every engine does.
    """
    schema_run = add_streams(schema_core, schema_core.grammar_compiler, [max_tokens] * len(free_lengths))
    free_run = add_streams(free_core, None, free_lengths)
    sides = [(schema_core, schema_run), (free_core, free_run)]
    while any(core.has_unfinished_requests() for core, _ in sides):
        for core, run in sides:
            if core.has_unfinished_requests():
                step_timed(core, run)
        sides.reverse()  # neither side always steps right after the other
    return schema_run, free_run


def compare(
    schema_core: EngineCore, free_core: EngineCore, streams: int, max_tokens: int, rounds: int
) -> dict:
    """Constrained vs free on the same per-stream token counts (``rounds`` side-by-side runs), and
    once against free streams that all run to max_tokens."""
    lengths = add_streams(schema_core, schema_core.grammar_compiler, [max_tokens] * streams)
    while schema_core.has_unfinished_requests():
        step_timed(schema_core, lengths)
    # The engines swap sides every round: two copies of the weights need not run equally fast.
    pairs = [
        side_by_side(*engines, max_tokens, lengths.tokens_per_stream)
        for engines in [(schema_core, free_core), (free_core, schema_core)] * (rounds // 2)
    ]
    constrained = [schema for schema, _ in pairs]
    free = [free for _, free in pairs]
    schema_rate = sum(r.tokens for r in constrained) / sum(r.seconds for r in constrained)
    free_rate = sum(r.tokens for r in free) / sum(r.seconds for r in free)
    schema_full, free_full = side_by_side(schema_core, free_core, max_tokens, [max_tokens] * streams)
    return {
        "streams": streams,
        "free_tok_s": free_rate,
        "schema_tok_s": schema_rate,
        "ratio": schema_rate / free_rate,
        "round_ratios": [schema.rate / free.rate for schema, free in pairs],
        "mean_batch": sum(r.tokens for r in constrained) / sum(r.steps for r in constrained),
        "tokens_per_stream": lengths.tokens_per_stream,
        "same_documents": all(r.tokens_per_stream == lengths.tokens_per_stream for r in constrained),
        "ratio_vs_full_length_free": schema_full.rate / free_full.rate,
    }


def run_structured_output_bench(model: str | None = None, dtype: str = "auto", quick: bool = False) -> dict:
    resolved = ensure_model(model, Path(os.environ.get("CACHET_DATA_DIR", "data")))
    torch_dtype = default_dtype(torch.device("cpu")) if dtype == "auto" else getattr(torch, dtype)
    tokenizer = Tokenizer.from_file(str(resolved.path / "tokenizer.json"))
    cores = []
    for _ in range(2):  # one engine per side; each holds its own copy of the weights
        runner = ModelRunner(
            resolved.path, dtype=torch_dtype, device=torch.device("cpu"), kv_cache_bytes=256 << 20
        )
        eos = list(runner.eos_token_ids)
        config = SchedulerConfig(
            max_model_len=runner.max_model_len, max_num_batched_tokens=2048, eos_token_ids=tuple(eos)
        )
        compiler = GrammarCompiler(tokenizer, runner.vocab_size, eos)
        cores.append(
            EngineCore(runner, model=resolved.model_id, scheduler_config=config, grammar_compiler=compiler)
        )
    schema_core, free_core = cores
    max_tokens, rounds = (32, 2) if quick else (96, 4)
    progress(f"structured output: {resolved.model_id}, {torch_dtype}, schema {_BENCH_SCHEMA!r}")
    side_by_side(schema_core, free_core, 8, [8])  # warm up both engines
    side_by_side(free_core, schema_core, 8, [8])
    rows = []
    for streams in (1, 8):
        progress(f"decode, {streams} streams, {rounds} side-by-side round(s)")
        rows.append(compare(schema_core, free_core, streams, max_tokens, rounds))
    compiles = compile_times(tokenizer, compiler.vocab_size, eos)
    _print(rows, compiles)
    return {"model": resolved.model_id, "dtype": str(torch_dtype), "decode": rows, "compile_ms": compiles}


def _print(rows: list[dict], compiles: dict[str, dict[str, float]]) -> None:
    print("\nStructured output: decode with a JSON schema vs free text (target ratio >= 0.9)")
    print("(same tokens per stream on both sides, stepped in turn; mean batch = tokens / steps of the")
    print(" constrained runs; last column: against free streams that all run to max_tokens, a fuller batch)")
    print(
        f"{'streams':<10}{'mean batch':>12}{'free tok/s':>14}{'schema tok/s':>14}{'ratio':>10}"
        f"{'vs full-length':>16}"
    )
    print("-" * 76)
    for row in rows:
        print(
            f"{row['streams']:<10}{row['mean_batch']:>12.1f}{row['free_tok_s']:>14.1f}"
            f"{row['schema_tok_s']:>14.1f}{row['ratio']:>10.2f}{row['ratio_vs_full_length_free']:>16.2f}"
        )
    for row in rows:
        rounds = ", ".join(f"{ratio:.2f}" for ratio in row["round_ratios"])
        same = "" if row["same_documents"] else " (a round's documents differed in length)"
        print(f"{row['streams']} streams, ratio per round: {rounds}{same}")
    print("\nGrammar compile per schema (ms): cold / cached")
    for name, t in compiles.items():
        print(f"{name:<20}{t['cold_ms']:>10.1f}{t['cached_ms']:>10.1f}")
