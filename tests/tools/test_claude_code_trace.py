"""Claude Code sessions to replay traces: exact calls from a log, rebuilt calls from totals, the trace's promises."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import pytest

from cachet.tools.claude_code_trace import (
    ClaudeCodeTraceShape,
    SessionShape,
    claude_code_trace,
    read_session_summaries,
    read_sessions,
    session_from_log,
    session_from_summary,
)

SUMMARIES = Path(__file__).resolve().parents[2] / "bench" / "traces" / "claude_code_sessions.jsonl"


def test_a_summary_is_rebuilt_into_linearly_growing_calls() -> None:
    # 5 calls of 1,000 .. 3,000 tokens add up to 10,000: 3,000 written to the cache, 7,000 read.
    record = {
        "first_prompt_tokens": 1000,
        "input_tokens": 0,
        "cache_creation_input_tokens": 3000,
        "cache_read_input_tokens": 7000,
        "output_tokens": 11,
        "duration_ms": 5000,
    }
    shape = session_from_summary(record)
    assert shape.prompt_tokens == (1000, 1500, 2000, 2500, 3000)
    assert shape.output_tokens == (3, 2, 2, 2, 2)
    assert shape.duration_ms == 5000


def _line(**event) -> str:
    return json.dumps(event) + "\n"


def test_a_log_gives_every_main_thread_call_exactly(tmp_path) -> None:
    def assistant(message_id: str, prompt: tuple[int, int, int], output: int, parent=None) -> str:
        usage = dict(
            zip(
                ("input_tokens", "cache_creation_input_tokens", "cache_read_input_tokens"),
                prompt,
                strict=True,
            )
        )
        message = {"id": message_id, "usage": {**usage, "output_tokens": output}}
        return _line(type="assistant", message=message, parent_tool_use_id=parent)

    log = tmp_path / "claude-code.txt"
    log.write_text(
        _line(type="system", subtype="init")
        + assistant("m1", (1, 18000, 0), 40)
        + assistant("m1", (1, 18000, 0), 40)  # a second content block of the same call
        + _line(type="user", message={"content": "tool output"})
        + assistant("sub", (5, 900, 0), 7, parent="toolu_1")  # a subagent's call: not this thread's
        + assistant("m2", (0, 2500, 18001), 90)
        + _line(type="result", duration_ms=61_000, num_turns=3)
    )
    shape = session_from_log(log)
    assert shape.prompt_tokens == (18001, 20501)
    assert shape.output_tokens == (40, 90)
    assert shape.duration_ms == 61_000
    # A log and a file of summaries are told apart by their first line.
    assert read_sessions(log) == [shape]
    assert len(read_sessions(SUMMARIES)) == 9
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(ValueError, match="empty"):
        read_sessions(tmp_path / "empty.jsonl")


def test_the_committed_public_sessions_load() -> None:
    shapes = read_session_summaries(SUMMARIES)
    assert len(shapes) == 9
    assert sum(len(shape.prompt_tokens) for shape in shapes) == 180
    assert max(max(shape.prompt_tokens) for shape in shapes) == 77_941
    assert all(shape.source.startswith("benchflow-ai/skillsbench-trajectories@") for shape in shapes)


SHAPE = SessionShape("test", prompt_tokens=(100, 260, 300), output_tokens=(5, 5, 5), duration_ms=3000)


def test_every_call_extends_the_conversation_and_only_the_shared_prefix_is_shared() -> None:
    trace = claude_code_trace(
        [SHAPE], ClaudeCodeTraceShape(sessions=3, block_tokens=64, shared_prefix_tokens=64)
    )
    sessions: dict[str, list] = defaultdict(list)
    for request in trace:
        sessions[request.session_id].append(request)
    assert [r.timestamp_ms for r in trace] == sorted(r.timestamp_ms for r in trace)
    owners: dict[int, str] = {}
    for session_id, calls in sessions.items():
        assert [c.input_length for c in calls] == [100, 260, 300]
        # 100 tokens: 1 full block + a partial one; 260: 4 full + partial; 300: 4 full + partial.
        assert [len(c.hash_ids) for c in calls] == [2, 5, 5]
        assert calls[0].hash_ids[0] == 0  # the shared system prefix
        assert calls[2].hash_ids[:4] == calls[1].hash_ids[:4]
        assert calls[1].hash_ids[:1] == calls[0].hash_ids[:1]
        for call in calls:
            for block_id in call.hash_ids[1:]:
                assert owners.setdefault(block_id, session_id) == session_id
        # A partial last block is never named again: an engine caches only full blocks.
        partials = [c.hash_ids[-1] for c in calls]
        assert len(set(partials)) == 3 and not set(partials) & set(calls[2].hash_ids[:4])


def test_the_seed_decides_the_trace() -> None:
    shapes = read_session_summaries(SUMMARIES)
    assert claude_code_trace(shapes, seed=1) == claude_code_trace(shapes, seed=1)
    assert claude_code_trace(shapes, seed=1) != claude_code_trace(shapes, seed=2)


def test_bad_shapes_are_refused() -> None:
    with pytest.raises(ValueError):
        claude_code_trace([], ClaudeCodeTraceShape())
    with pytest.raises(ValueError):
        ClaudeCodeTraceShape(sessions=0)
    with pytest.raises(ValueError):
        SessionShape("x", prompt_tokens=(1, 2), output_tokens=(1,), duration_ms=0)
