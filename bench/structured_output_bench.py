"""Structured-output benchmark: decode throughput with a JSON schema vs without, and compile times.

- decode tokens/s on the default model at 1 and 8 concurrent streams, free text vs constrained
  by a JSON schema (target: constrained >= 0.9x free). Both sides decode the same work: each
  constrained stream stops when its document is complete, so the free run gives every stream
  exactly the token count its constrained twin produced (``ignore_eos``). Otherwise the
  constrained batch thins out as documents finish (a mean batch of ~6 of 8 measured) while the
  free one stays full, and the ratio measures batch size, not the grammar. Rounds run in ABBA
  order (constrained, free, free, constrained) in one process because these CPUs drift 30-40%
  between runs minutes apart;
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


def _progress(message: str) -> None:
    print(f"[bench] {message}", flush=True)


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
    """One batch of concurrent streams decoded to the end."""

    tokens_per_stream: list[int]
    seconds: float
    steps: int

    @property
    def tokens(self) -> int:
        return sum(self.tokens_per_stream)


def decode(core: EngineCore, compiler: GrammarCompiler | None, lengths: list[int]) -> DecodeRun:
    """Decode one stream per entry of ``lengths`` (its max_tokens), seeded at temperature 0.7.

    With ``compiler`` the streams follow the bench schema and stop when their document is done;
    without, they ignore EOS and run to exactly their length.
    """
    spec = schema_spec(load_schemas()[_BENCH_SCHEMA])
    ids = []
    for i, max_tokens in enumerate(lengths):
        grammar = RequestGrammar.create(compiler, spec) if compiler is not None else None
        prompt = [1, *range(1000 + 7 * i, 1032 + 7 * i)]
        params = SamplingParams(temperature=0.7, seed=i, ignore_eos=compiler is None)
        ids.append(f"r{time.monotonic_ns()}-{i}")
        core.add_request(Request(ids[-1], prompt, params, max_tokens, grammar=grammar))
    while any(r.grammar is not None and not r.grammar.ready for r in core.scheduler.waiting):
        time.sleep(0.001)  # compiles are not what this measures
    produced = dict.fromkeys(ids, 0)
    steps, start = 0, time.perf_counter()
    while core.has_unfinished_requests():
        for output in core.step():
            produced[output.request_id] += len(output.new_token_ids)
        steps += 1
    return DecodeRun([produced[i] for i in ids], time.perf_counter() - start, steps)


def compare(core: EngineCore, compiler: GrammarCompiler, streams: int, max_tokens: int, rounds: int) -> dict:
    """Constrained vs free on the same per-stream token counts, ``rounds`` ABBA pairs."""
    constrained: list[DecodeRun] = []
    free: list[DecodeRun] = []
    for round_index in range(rounds):
        if round_index % 2 == 0:
            constrained.append(decode(core, compiler, [max_tokens] * streams))
            free.append(decode(core, None, constrained[-1].tokens_per_stream))
        else:
            # Free first: seeded streams write the same documents again, so last round's counts hold.
            free.append(decode(core, None, constrained[-1].tokens_per_stream))
            constrained.append(decode(core, compiler, [max_tokens] * streams))
    schema_rate = sum(r.tokens for r in constrained) / sum(r.seconds for r in constrained)
    free_rate = sum(r.tokens for r in free) / sum(r.seconds for r in free)
    # The former measure, for comparison: free streams all run to max_tokens, the batch stays full.
    full = decode(core, None, [max_tokens] * streams)
    return {
        "streams": streams,
        "free_tok_s": free_rate,
        "schema_tok_s": schema_rate,
        "ratio": schema_rate / free_rate,
        "full_length_free_tok_s": full.tokens / full.seconds,
        "ratio_vs_full_length_free": schema_rate / (full.tokens / full.seconds),
        "mean_batch": sum(r.tokens for r in constrained) / sum(r.steps for r in constrained),
        "tokens_per_stream": constrained[0].tokens_per_stream,
    }


def run_structured_output_bench(model: str | None = None, dtype: str = "auto", quick: bool = False) -> dict:
    resolved = ensure_model(model, Path(os.environ.get("CACHET_DATA_DIR", "data")))
    torch_dtype = default_dtype(torch.device("cpu")) if dtype == "auto" else getattr(torch, dtype)
    tokenizer = Tokenizer.from_file(str(resolved.path / "tokenizer.json"))
    runner = ModelRunner(resolved.path, dtype=torch_dtype, device=torch.device("cpu"), kv_cache_bytes=1 << 30)
    eos = list(runner.eos_token_ids)
    compiler = GrammarCompiler(tokenizer, runner.vocab_size, eos)
    config = SchedulerConfig(
        max_model_len=runner.max_model_len, max_num_batched_tokens=2048, eos_token_ids=tuple(eos)
    )
    core = EngineCore(runner, model=resolved.model_id, scheduler_config=config, grammar_compiler=compiler)
    max_tokens, rounds = (32, 1) if quick else (96, 2)
    _progress(f"structured output: {resolved.model_id}, {torch_dtype}, schema {_BENCH_SCHEMA!r}")
    decode(core, compiler, [8])  # warm up both paths
    decode(core, None, [8])
    rows = []
    for streams in (1, 8):
        _progress(f"decode, {streams} streams, {rounds} round(s) of constrained and free")
        rows.append(compare(core, compiler, streams, max_tokens, rounds))
    compiles = compile_times(tokenizer, runner.vocab_size, eos)
    _print(rows, compiles)
    return {"model": resolved.model_id, "dtype": str(torch_dtype), "decode": rows, "compile_ms": compiles}


def _print(rows: list[dict], compiles: dict[str, dict[str, float]]) -> None:
    print("\nStructured output: decode with a JSON schema vs free text (target ratio >= 0.9)")
    print("(same tokens per stream on both sides; mean batch = tokens / steps of the constrained runs;")
    print(" last column: against free streams that all run to max_tokens, a fuller batch)")
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
    print("\nGrammar compile per schema (ms): cold / cached")
    for name, t in compiles.items():
        print(f"{name:<20}{t['cold_ms']:>10.1f}{t['cached_ms']:>10.1f}")
