"""The serving bench's table: measures read from the result files vLLM's client writes.

Each scenario's result is the dict ``vllm.benchmarks.serve`` saves with ``--save-result``
(``output_throughput`` in tok/s, ``mean_ttft_ms``, ``mean_tpot_ms``, ...). A measure
names the scenario it reads and how it turns that dict into one number; a server that
was not measured (or a scenario that failed) leaves its cell empty.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

Result = dict[str, Any]
SERVERS = ("cachet", "vllm")
HEADERS = {"cachet": "Cachet", "vllm": "vLLM-CPU"}


def output_tok_s(result: Result) -> float:
    return float(result["output_throughput"])


def mean_ttft_ms(result: Result) -> float:
    return float(result["mean_ttft_ms"])


def mean_tpot_ms(result: Result) -> float:
    return float(result["mean_tpot_ms"])


def decode_tok_s(result: Result) -> float | None:
    """One stream's decode rate: a token every TPOT ms (TPOT leaves the first token out)."""
    tpot = float(result["mean_tpot_ms"])
    return 1000.0 / tpot if tpot > 0 else None


@dataclass(frozen=True)
class Measure:
    label: str
    scenario: str
    read: Callable[[Result], float | None]
    higher_is_better: bool

    def value(self, results: dict[str, Result]) -> float | None:
        result = results.get(self.scenario)
        return None if result is None else self.read(result)


def ratio(cachet: float | None, vllm: float | None) -> float | None:
    """Cachet ÷ vLLM; whether above 1 is good depends on the measure's direction."""
    if cachet is None or not vllm:
        return None
    return cachet / vllm


def table_rows(measures: list[Measure], by_server: dict[str, dict[str, Result]]) -> list[dict]:
    """One row per measure: both servers' values, the ratio and the direction (also the JSON's table)."""
    rows = []
    for measure in measures:
        values = {server: measure.value(by_server.get(server, {})) for server in SERVERS}
        rows.append(
            {
                "measure": measure.label,
                **values,
                "cachet_over_vllm": ratio(values["cachet"], values["vllm"]),
                "better": "higher" if measure.higher_is_better else "lower",
            }
        )
    return rows


def _cell(value: float | None, width: int, digits: int) -> str:
    return f"{'-':>{width}}" if value is None else f"{value:>{width},.{digits}f}"


def format_table(rows: list[dict]) -> str:
    label_width = max(len(row["measure"]) for row in rows) + 2
    header = (
        f"{'measure':<{label_width}}{HEADERS['cachet']:>12}{HEADERS['vllm']:>12}"
        f"{'Cachet ÷ vLLM':>15}   better"
    )
    lines = [header, "-" * len(header)]
    for row in rows:
        lines.append(
            f"{row['measure']:<{label_width}}{_cell(row['cachet'], 12, 1)}{_cell(row['vllm'], 12, 1)}"
            f"{_cell(row['cachet_over_vllm'], 15, 2)}   {row['better']}"
        )
    return "\n".join(lines)
