"""The agent trace generator keeps its promises: growing conversations, a shared prefix, interleaving."""

from __future__ import annotations

import math
from collections import defaultdict

import pytest

from cachet.tools.agent_traces import AgentTraceShape, agent_trace
from cachet.tools.trace import TraceRequest, read_trace, write_trace

SHAPE = AgentTraceShape(sessions=12, turns=6)


def by_session(trace: list[TraceRequest]) -> dict[str, list[TraceRequest]]:
    sessions: dict[str, list[TraceRequest]] = defaultdict(list)
    for request in trace:
        sessions[request.session_id].append(request)
    return sessions


def test_every_turn_extends_the_previous_turn_of_its_session() -> None:
    sessions = by_session(agent_trace(SHAPE, seed=3))
    assert sorted(sessions) == sorted(f"session-{i}" for i in range(SHAPE.sessions))
    for turns in sessions.values():
        assert len(turns) == SHAPE.turns
        for before, after in zip(turns, turns[1:], strict=False):
            assert len(after.hash_ids) > len(before.hash_ids)
            assert after.hash_ids[: len(before.hash_ids)] == before.hash_ids
            # The answer and the tool output fill whole blocks, so at least the answer fits.
            appended = len(after.hash_ids) - len(before.hash_ids)
            assert appended >= math.ceil(before.output_length / SHAPE.block_tokens)


def test_sessions_share_the_system_prefix_and_nothing_else() -> None:
    trace = agent_trace(SHAPE, seed=3)
    shared = tuple(range(SHAPE.shared_prefix_blocks))
    owners: dict[int, str] = {}
    for request in trace:
        assert request.hash_ids[: len(shared)] == shared
        assert request.input_length == len(request.hash_ids) * SHAPE.block_tokens
        for block_id in request.hash_ids[len(shared) :]:
            assert owners.setdefault(block_id, request.session_id) == request.session_id


def test_turns_interleave_across_sessions_and_wait_for_the_answer() -> None:
    trace = agent_trace(SHAPE, seed=3)
    stamps = [request.timestamp_ms for request in trace]
    assert stamps == sorted(stamps)
    # Interleaved: the session order changes along the trace far more often than once per session.
    switches = sum(a.session_id != b.session_id for a, b in zip(trace, trace[1:], strict=False))
    assert switches > 2 * SHAPE.sessions
    for turns in by_session(trace).values():
        for before, after in zip(turns, turns[1:], strict=False):
            answer_ms = 1000 * (
                before.input_length / SHAPE.prefill_tokens_per_s
                + before.output_length / SHAPE.decode_tokens_per_s
            )
            assert after.timestamp_ms - before.timestamp_ms >= answer_ms + SHAPE.tool_latency_ms[0]


def test_the_seed_decides_the_trace() -> None:
    assert agent_trace(SHAPE, seed=5) == agent_trace(SHAPE, seed=5)
    assert agent_trace(SHAPE, seed=5) != agent_trace(SHAPE, seed=6)


def test_a_trace_survives_a_round_trip_through_its_file(tmp_path) -> None:
    trace = agent_trace(SHAPE, seed=1)
    path = tmp_path / "agent.jsonl"
    assert write_trace(path, trace) == len(trace)
    assert read_trace(path) == trace


def test_a_shape_without_sessions_is_refused() -> None:
    with pytest.raises(ValueError):
        AgentTraceShape(sessions=0)
