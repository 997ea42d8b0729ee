"""`cachet trace agent` and `cachet replay` through the real command line (typer's runner)."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from cachet.tools.cli import app
from cachet.tools.trace import read_trace


def test_generate_then_replay_as_json(tmp_path) -> None:
    runner = CliRunner()
    trace = tmp_path / "agent.jsonl"
    generated = runner.invoke(
        app, ["trace", "agent", str(trace), "--sessions", "8", "--turns", "4", "--seed", "2"]
    )
    assert generated.exit_code == 0, generated.output
    assert len(read_trace(trace)) == 32

    replayed = runner.invoke(
        app, ["replay", str(trace), "--json", "--replicas", "2", "--blocks-per-replica", "64", "--seed", "1"]
    )
    assert replayed.exit_code == 0, replayed.output
    document = json.loads(replayed.output)
    assert set(document) == {
        "ideal_cached_token_ratio",
        "session_retention_seconds",
        "retained_requests",
        "policies",
    }
    assert set(document["policies"]) == {"affinity", "cache-aware", "round-robin", "random"}
    figure_keys = {"cached_token_ratio", "max_load_over_mean", "cost_usd", "saving_usd"}
    for figures in document["policies"].values():
        assert set(figures) == {*figure_keys, "without_retention"}
        assert set(figures["without_retention"]) == figure_keys
        for run in (figures, figures["without_retention"]):
            assert 0.0 <= run["cached_token_ratio"] <= document["ideal_cached_token_ratio"]
            assert 1.0 <= run["max_load_over_mean"] <= 2.0


def test_tiers_from_the_command_line(tmp_path) -> None:
    runner = CliRunner()
    trace = tmp_path / "agent.jsonl"
    runner.invoke(app, ["trace", "agent", str(trace), "--sessions", "8", "--turns", "4", "--seed", "2"])
    args = ["replay", str(trace), "--json", "--replicas", "2", "--blocks-per-replica", "24"]
    plain = json.loads(runner.invoke(app, args).output)
    tiered = runner.invoke(app, [*args, "--host-blocks-per-replica", "64", "--shared-blocks", "128"])
    assert tiered.exit_code == 0, tiered.output
    for policy, figures in json.loads(tiered.output)["policies"].items():
        assert figures["cached_token_ratio"] > plain["policies"][policy]["cached_token_ratio"]
        assert figures["cost_usd"] < plain["policies"][policy]["cost_usd"]
    refused = runner.invoke(app, [*args, "--shared-blocks", "-1"])
    assert refused.exit_code != 0


def test_replay_prints_a_table_by_default(tmp_path) -> None:
    runner = CliRunner()
    trace = tmp_path / "agent.jsonl"
    runner.invoke(app, ["trace", "agent", str(trace), "--sessions", "4", "--turns", "3"])
    replayed = runner.invoke(app, ["replay", str(trace)])
    assert replayed.exit_code == 0, replayed.output
    assert "ideal cached-token ratio" in replayed.output
    for policy in ("affinity", "cache-aware", "round-robin", "random"):
        assert f"\n{policy} " in replayed.output


def test_a_trace_from_the_public_claude_code_sessions(tmp_path) -> None:
    summaries = Path(__file__).resolve().parents[2] / "bench" / "traces" / "claude_code_sessions.jsonl"
    out = tmp_path / "cc.jsonl"
    made = CliRunner().invoke(
        app, ["trace", "claude-code", str(out), str(summaries), "--sessions", "5", "--block-tokens", "256"]
    )
    assert made.exit_code == 0, made.output
    assert "from 9 sessions, 180 calls" in made.output
    trace = read_trace(out)
    assert len({request.session_id for request in trace}) == 5
    assert all(request.input_length >= 18_259 for request in trace)
