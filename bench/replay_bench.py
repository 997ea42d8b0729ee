"""Replay benchmark: placement policies on prefix-reuse traces (no model; see cachet.tools.replay).

Two traces on 4 simulated replicas of 4,096 blocks × 512 tokens:

- a generated agent trace (256 sessions × 16 turns, seed 0), where the targets are
  affinity and cache-aware placement at >= 0.95 × the ideal cached-token ratio,
  with round-robin as the floor;
- the Mooncake conversation trace (``../shared/traces/`` beside the checkout; no
  sessions, so affinity places exactly as cache-aware), skipped when absent;
  once more with 4x the KV per replica, to show how much of the gap to the ideal
  is capacity rather than placement.

Runs in about 25 s on one core.
"""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

from cachet.tools.agent_traces import AgentTraceShape, agent_trace
from cachet.tools.replay import ReplayConfig, ReplayReport, replay
from cachet.tools.trace import TraceRequest, read_trace

MOONCAKE_TRACE = (
    Path(__file__).resolve().parents[1].parent / "shared" / "traces" / "mooncake_conversation_trace.jsonl"
)
AGENT_SHAPE = AgentTraceShape(sessions=256, turns=16)
CONFIG = ReplayConfig(replicas=4, blocks_per_replica=4096, block_tokens=512)
# Share of the ideal cached-token ratio that session- and cache-aware placement must reach.
TARGET_OF_IDEAL = 0.95
TARGETED = ("affinity", "cache-aware")


def run_replay_bench() -> dict[str, dict]:
    print("[bench] replay: placement policies on prefix-reuse traces", flush=True)
    results = {"agent": _timed("agent", agent_trace(AGENT_SHAPE, seed=0), CONFIG, targets=True)}
    if not MOONCAKE_TRACE.exists():
        print(f"\n[bench] replay: {MOONCAKE_TRACE} not found; Mooncake replay skipped")
        return results
    mooncake = read_trace(MOONCAKE_TRACE)
    results["mooncake"] = _timed("mooncake", mooncake, CONFIG, targets=False)
    # 4x the KV per replica: how much of the gap to the ideal is capacity rather than placement.
    roomy = replace(CONFIG, blocks_per_replica=4 * CONFIG.blocks_per_replica)
    results["mooncake_4x_capacity"] = _timed("mooncake", mooncake, roomy, targets=False)
    return results


def _timed(name: str, trace: list[TraceRequest], config: ReplayConfig, *, targets: bool) -> dict:
    start = time.perf_counter()
    report = replay(trace, config)
    seconds = time.perf_counter() - start
    _print_table(name, report, config, targets)
    return {
        **report.to_json(),
        "requests": report.requests,
        "blocks_per_replica": config.blocks_per_replica,
        "seconds": round(seconds, 2),
    }


def _print_table(name: str, report: ReplayReport, config: ReplayConfig, targets: bool) -> None:
    ideal = report.ideal_cached_token_ratio
    floor = report.policies["round-robin"].cached_token_ratio
    print(
        f"\nReplay: {name} trace, {report.requests} requests, {config.replicas} replicas × "
        f"{config.blocks_per_replica} blocks of {config.block_tokens} tokens"
    )
    print(f"{'policy':<14}{'cached ratio':>13}{'× ideal':>9}{'load max/mean':>15}  target")
    print("-" * 72)
    print(f"{'ideal':<14}{ideal:>13.4f}{1.0:>9.3f}{'':>15}  one unlimited cache")
    for policy, figures in report.policies.items():
        ratio = figures.cached_token_ratio
        if policy == "round-robin":
            target = "the floor"
        elif targets and policy in TARGETED:
            met = ratio >= TARGET_OF_IDEAL * ideal and ratio > floor
            target = f">= {TARGET_OF_IDEAL} × ideal: {'met' if met else 'MISSED'}"
        else:
            target = f"{ratio - floor:+.4f} over the floor"
        print(
            f"{policy:<14}{ratio:>13.4f}{ratio / ideal if ideal else 0.0:>9.3f}"
            f"{figures.max_load_over_mean:>15.3f}  {target}"
        )
