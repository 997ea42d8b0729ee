"""Schema coverage: how many real-world JSON schemas Cachet's ``response_format: json_schema`` accepts.

Each schema file under ``--corpus DIR`` (``DIR/<category>/<name>.json``, the layout of
JSONSchemaBench's ``data/`` folder; default ``$CACHET_SCHEMA_CORPUS``) goes the way a request's
schema goes: the ``ResponseFormat`` proto -> ``grammar_spec_from_proto`` -> ``GrammarCompiler``
(the engine's llguidance options and warning policy) -> a request's matcher, plus the router's
``AnswerCheck``, built where decoding approximates the schema. Each ends as one of:

- ``compiled``: a request with this schema would decode; ``checked`` counts those whose answers
  the router checks against the whole schema (decoding left something out: oneOf decoded as
  anyOf, a keyword the lenient compile ignored), with what was left out as the reason;
- ``declined_cachet``: refused by Cachet's own checks (not JSON, not an object, strict-mode
  unsupported keywords, the router's answer check);
- ``declined_llguidance``: llguidance's converter or grammar validation refused it;
- ``timeout``: no compile within ``--timeout`` seconds.

Both ``strict: false`` (the API default) and ``strict: true`` are run. No corpus: the section says
so in one line and is skipped. ``python -m bench.schema_coverage_bench --corpus DIR``.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import re
import tempfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer

from bench.progress import progress
from cachet.common.v1 import common_pb2
from cachet.engine.errors import InvalidRequest
from cachet.engine.structured_output import GrammarCompiler, grammar_spec_from_proto
from cachet.models.tiny import write_tiny_model
from cachet.router.answer_check import AnswerCheck, approximations

OUTCOMES = ("compiled", "declined_cachet", "declined_llguidance", "timeout")
_LLGUIDANCE_PREFIX = "invalid response_format.json_schema.schema: "
_TIMEOUT_SECONDS = 10.0


@dataclass(frozen=True)
class Outcome:
    """One schema's fate: which of ``OUTCOMES``, and the reason (when compiled: what the router checks)."""

    kind: str
    reason: str = ""
    checked: bool = False  # compiled, and the router checks its answers


def classify_error(message: str) -> Outcome:
    """A compile's InvalidRequest -> who declined it and a reason short enough to group by."""
    if message.startswith(_LLGUIDANCE_PREFIX):
        return Outcome("declined_llguidance", reason_kind(message[len(_LLGUIDANCE_PREFIX) :]))
    return Outcome("declined_cachet", reason_kind(message))


def reason_kind(message: str) -> str:
    """The message's first line with long names, paths and numbers masked, so equal causes group."""
    line = message.strip().splitlines()[0] if message.strip() else "(no message)"
    line = re.sub(r'"[^"]{25,}"|`[^`]{25,}`', "<x>", line)  # long names and paths; keywords stay
    return re.sub(r"\d+", "N", line)[:90]


def compile_outcome(compiler: GrammarCompiler, text: str, strict: bool, timeout: float) -> Outcome:
    """``text`` as a request's json_schema response format, through the engine's compile + matcher."""
    fmt = common_pb2.ResponseFormat(json_schema=common_pb2.JsonSchemaFormat(schema_json=text, strict=strict))
    try:
        spec = grammar_spec_from_proto(fmt)
        assert spec is not None
        compiler.new_matcher(spec).result(timeout=timeout)
        checked = AnswerCheck.for_format(fmt) is not None
    except concurrent.futures.TimeoutError:
        return Outcome("timeout", f"over {timeout:g} s")
    except InvalidRequest as error:
        return classify_error(str(error))
    except Exception as error:  # noqa: BLE001 - the router's jsonschema refusing the schema
        return Outcome("declined_cachet", f"answer check: {reason_kind(str(error))}")
    left_out = "; ".join(reason_kind(warning) for warning in approximations(text)) if checked else ""
    return Outcome("compiled", left_out, checked)


def corpus_files(corpus: Path) -> dict[str, list[Path]]:
    """Category -> its schema files, sorted."""
    categories = sorted(path for path in corpus.iterdir() if path.is_dir())
    return {c.name: sorted(c.glob("*.json")) for c in categories if any(c.glob("*.json"))}


def tokenizer_compiler(workdir: Path) -> GrammarCompiler:
    """A compiler on the default model's tokenizer (via the tiny checkpoint): no weights needed."""
    model_dir = write_tiny_model(workdir / "tiny-llama")
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    return GrammarCompiler(tokenizer, tokenizer.get_vocab_size(), [2], max_workers=2, cache_size=4)


def run_category(compiler: GrammarCompiler, files: list[Path], strict: bool, timeout: float) -> list[dict]:
    rows = []
    for path in files:
        outcome = compile_outcome(compiler, path.read_text(encoding="utf-8"), strict, timeout)
        rows.append(
            {
                "schema": path.name,
                "outcome": outcome.kind,
                "reason": outcome.reason,
                "checked": outcome.checked,
            }
        )
    return rows


def summarize(rows: list[dict]) -> dict:
    counts = Counter(row["outcome"] for row in rows)
    total = len(rows)
    declined = total - counts["compiled"]
    summary = {"count": total, **{kind: counts[kind] for kind in OUTCOMES}}
    summary["checked"] = sum(1 for row in rows if row.get("checked"))
    summary["decline_rate"] = round(declined / total, 4) if total else 0.0
    return summary


def top_reasons(rows: list[dict], limit: int = 8) -> list[tuple[str, int]]:
    """Why schemas were declined, then what the router checks in those that compiled."""
    reasons = Counter(f"{row['outcome']}: {row['reason']}" for row in rows if row["outcome"] != "compiled")
    checked = Counter(f"checked: {row['reason']}" for row in rows if row.get("checked"))
    return reasons.most_common(limit) + checked.most_common(limit)


def print_table(title: str, by_category: dict[str, list[dict]]) -> None:
    print(f"\n{title}")
    print(
        f"{'category':<18}{'count':>6}{'compiled':>10}{'checked':>9}{'cachet':>8}{'llg':>6}{'timeout':>8}"
        f"{'declined':>10}"
    )
    print("-" * 75)
    everything = [row for rows in by_category.values() for row in rows]
    for name, rows in [*by_category.items(), ("total", everything)]:
        s = summarize(rows)
        print(
            f"{name:<18}{s['count']:>6}{s['compiled']:>10}{s['checked']:>9}{s['declined_cachet']:>8}"
            f"{s['declined_llguidance']:>6}{s['timeout']:>8}{s['decline_rate']:>10.1%}"
        )
    for reason, count in top_reasons(everything):
        print(f"  {count:>4}  {reason}")


def run_mode(compiler: GrammarCompiler, files: dict[str, list[Path]], strict: bool, timeout: float) -> dict:
    by_category = {}
    for name, paths in files.items():
        progress(f"schema coverage (strict={strict}): {name}, {len(paths)} schemas")
        by_category[name] = run_category(compiler, paths, strict, timeout)
    everything = [row for rows in by_category.values() for row in rows]
    print_table(f"Schema coverage, strict={strict} (sample of {len(everything)} schemas)", by_category)
    return {
        "categories": {name: summarize(rows) for name, rows in by_category.items()},
        "total": summarize(everything),
        "top_reasons": top_reasons(everything),
        "schemas": by_category,
    }


def run_schema_coverage_bench(corpus: str | None = None, timeout: float = _TIMEOUT_SECONDS) -> dict:
    """Both strict modes over the corpus; ``{"skipped": why}`` when there is no corpus."""
    corpus = corpus or os.environ.get("CACHET_SCHEMA_CORPUS")
    if not corpus or not Path(corpus).is_dir():
        why = f"no schema corpus (--corpus DIR or CACHET_SCHEMA_CORPUS; got {corpus!r})"
        print(f"[bench] schema coverage skipped: {why}", flush=True)
        return {"skipped": why}
    files = corpus_files(Path(corpus))
    with tempfile.TemporaryDirectory(prefix="cachet-schema-coverage-") as workdir:
        compiler = tokenizer_compiler(Path(workdir))
        try:
            modes = {
                f"strict={strict}": run_mode(compiler, files, strict, timeout) for strict in (False, True)
            }
        finally:
            compiler.shutdown()
    sizes = {name: len(paths) for name, paths in files.items()}
    return {"corpus": str(corpus), "sample_size": sum(sizes.values()), "per_category": sizes, **modes}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--corpus", default=None, help="DIR/<category>/<name>.json (default: $CACHET_SCHEMA_CORPUS)"
    )
    parser.add_argument("--timeout", type=float, default=_TIMEOUT_SECONDS, help="seconds per compile")
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parser.parse_args()
    results = run_schema_coverage_bench(args.corpus, args.timeout)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
