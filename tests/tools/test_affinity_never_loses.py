"""Placement property: a session key never costs cached tokens.

For each trace (real Claude Code session shapes and the synthetic agent trace, at
KV capacities from ample to far too small), the affinity policy on the trace with
its session ids must serve at least the cached tokens that the same placement code
serves on the same trace with every session id removed, less one thing: spreading
sessions over replicas that the keyless placement left idle makes each of those
compute the system prefix that every session shares once. With ample KV (nothing
ever evicted) that is the whole difference, and keeping it would mean piling every
session on one replica (max/mean load 2.4 on the agent trace below): so the
allowance is exactly one shared prefix per replica the keyless run never used.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from cachet.router.placement import PlacementPolicy
from cachet.tools.agent_traces import AgentTraceShape, agent_trace
from cachet.tools.claude_code_trace import ClaudeCodeTraceShape, claude_code_trace, read_session_summaries
from cachet.tools.replay import ReplayConfig, replay
from cachet.tools.trace import TraceRequest

SUMMARIES = Path(__file__).resolve().parents[2] / "bench" / "traces" / "claude_code_sessions.jsonl"


def _claude_code(seed: int) -> list[TraceRequest]:
    shape = ClaudeCodeTraceShape(sessions=24, block_tokens=256, start_window_ms=120_000)
    return claude_code_trace(read_session_summaries(SUMMARIES), shape, seed=seed)


def _agent(seed: int) -> list[TraceRequest]:
    return agent_trace(AgentTraceShape(sessions=48, turns=8), seed=seed)


def _without_sessions(trace: list[TraceRequest]) -> list[TraceRequest]:
    return [replace(request, session_id="") for request in trace]


CASES = [
    # (trace, block tokens, blocks per replica): ample KV, some pressure, far too little.
    *((_claude_code, seed, 256, blocks) for seed in (0, 1) for blocks in (200, 400, 1000)),
    *((_agent, seed, 512, blocks) for seed in (0, 1) for blocks in (64, 256, 1024)),
]


@pytest.mark.parametrize(("make", "seed", "block_tokens", "blocks"), CASES)
def test_a_session_key_never_lowers_the_cached_token_ratio(make, seed, block_tokens, blocks) -> None:
    trace = make(seed)
    config = ReplayConfig(block_tokens=block_tokens, blocks_per_replica=blocks)
    keyed_report = replay(trace, config, policies=("affinity",))
    keyed = keyed_report.policies["affinity"]
    unkeyed = replay(_without_sessions(trace), config, policies=("affinity",)).policies["affinity"]
    assert unkeyed.reasons.keys() == {"score"}
    idle_replicas = unkeyed.requests.count(0)
    allowance = idle_replicas * _shared_prefix_tokens(trace, block_tokens)
    tokens = keyed_report.input_tokens
    assert keyed.cached_token_ratio * tokens >= unkeyed.cached_token_ratio * tokens - allowance
    if not idle_replicas:
        assert keyed.cached_token_ratio >= unkeyed.cached_token_ratio


def _shared_prefix_tokens(trace: list[TraceRequest], block_tokens: int) -> int:
    """Tokens of the leading blocks that every request of the trace starts with."""
    first = trace[0].hash_ids
    shared = min(
        next((i for i, (a, b) in enumerate(zip(first, r.hash_ids, strict=False)) if a != b), len(r.hash_ids))
        for r in trace
    )
    return shared * block_tokens


def test_new_sessions_that_may_not_give_up_the_shared_prefix_pile_up() -> None:
    # Every Claude Code session starts with the same 12,000-token system prompt and tools: a
    # new session that must follow it lands on the first replica that cached it.
    trace = _claude_code(0)
    config = ReplayConfig(block_tokens=256, blocks_per_replica=1000)
    greedy = replace(config, placement=PlacementPolicy(new_session_slack_tokens=0))
    piled = replay(trace, greedy, policies=("affinity",)).policies["affinity"]
    spread = replay(trace, config, policies=("affinity",)).policies["affinity"]
    assert piled.max_load_over_mean > 1.8 > 1.4 > spread.max_load_over_mean
