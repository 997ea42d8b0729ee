"""Retention in the replay: exact eviction orders in a simulated replica and its tiers on a tiny
hand-made agent session (its prefix outlives a burst of other traffic during its tool pause only
when retained), what each request is retained for, and the figures with and without retention."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from cachet.router.cache_retention import RETENTION_SECONDS, SETTING_VALUES
from cachet.router.settings import RouterSettings
from cachet.tools.cli import app
from cachet.tools.lru_tier import LruTier
from cachet.tools.replay import (
    DEFAULT_SESSION_RETENTION_SECONDS,
    ReplayConfig,
    replay,
    retention_seconds,
)
from cachet.tools.simulated_replica import ServiceTimeModel, SimulatedReplica
from cachet.tools.trace import TraceRequest, write_trace

# One replica of 4 blocks of 10 tokens. No output: a 20-token prompt is in flight for 2 ms
# (20 tokens at 10k tokens/s), so a retention of R seconds lasts until R + 0.002.
SESSION = TraceRequest(0, 20, 0, (1, 2), "agent")
BURST = [TraceRequest(1000, 20, 0, (10, 11)), TraceRequest(2000, 20, 0, (12, 13))]
# The agent's tool ran for a minute; its next turn resends the conversation and adds a block.
NEXT_TURN = TraceRequest(60_000, 30, 0, (1, 2, 3), "agent")
TRACE = [SESSION, *BURST, NEXT_TURN]


def _replica(host_blocks: int = 0) -> SimulatedReplica:
    return SimulatedReplica(
        "r", num_blocks=4, block_tokens=10, service=ServiceTimeModel(), host_blocks=host_blocks
    )


def _serve(replica: SimulatedReplica, request: TraceRequest, retention_s: float) -> int:
    served = replica.serve(
        request.hash_ids, request.input_length, request.output_length, request.timestamp_ms, retention_s
    )
    replica.pool.check_invariants()
    if replica.host is not None:
        replica.host.check_invariants()
    return served.cached_tokens


def test_a_retained_prefix_outlives_a_burst_during_the_tool_pause() -> None:
    replica = _replica()
    assert _serve(replica, SESSION, 600) == 0
    # Blocks 0, 1 hold the session (hashes 1, 2), freed tail first and retained: behind the
    # unused blocks 2, 3, the tail (block 1) first.
    assert replica.pool.free_block_ids() == [2, 3, 1, 0]
    assert replica.pool.retained_until(0) == pytest.approx(600.002)
    _serve(replica, BURST[0], 0)
    assert replica.pool.free_block_ids() == [3, 2, 1, 0]
    # The second burst request evicts the first one's blocks (11, then 10), not the session's.
    _serve(replica, BURST[1], 0)
    assert replica.pool.free_block_ids() == [2, 3, 1, 0]
    assert replica.pool.cached_hashes() == {1, 2, 12, 13}
    assert _serve(replica, NEXT_TURN, 600) == 20
    assert replica.block_retentions == 2 + 3


def test_without_retention_the_burst_evicts_the_prefix() -> None:
    replica = _replica()
    _serve(replica, SESSION, 0)
    _serve(replica, BURST[0], 0)
    # Plain LRU: the session's blocks (freed at 0 s) are now the least recently used.
    assert replica.pool.free_block_ids() == [1, 0, 3, 2]
    _serve(replica, BURST[1], 0)
    assert replica.pool.cached_hashes() == {10, 11, 12, 13}
    assert _serve(replica, NEXT_TURN, 0) == 0
    assert replica.block_retentions == 0


def test_a_retention_shorter_than_the_pause_ends_and_the_prefix_goes_as_lru() -> None:
    replica = _replica()
    _serve(replica, SESSION, 1)  # retained until 1.002 s
    _serve(replica, BURST[0], 0)  # at 1 s: still retained
    assert replica.pool.free_block_ids() == [3, 2, 1, 0]
    assert replica.pool.num_retained_blocks == 2
    # At 2 s the retention is over: the session's blocks rejoin the LRU as if freed at 1.002 s,
    # after the first burst request's (freed at 1 s), and go after them.
    _serve(replica, BURST[1], 0)
    assert replica.pool.num_retained_blocks == 0
    assert replica.pool.cached_hashes() == {1, 2, 12, 13}
    assert replica.pool.free_block_ids() == [1, 0, 2, 3]
    # A third request takes the session's blocks: it left retention long before.
    _serve(replica, TraceRequest(3000, 20, 0, (14, 15)), 0)
    assert _serve(replica, NEXT_TURN, 0) == 0


@pytest.mark.parametrize(("host_blocks", "cached", "from_host"), [(0, 10, 0), (2, 20, 10)])
def test_retention_never_refuses_room_and_a_retained_block_is_demoted(host_blocks, cached, from_host) -> None:
    replica = _replica(host_blocks)
    for request in (SESSION, *BURST):
        _serve(replica, request, 600 if request.session_id else 0)
    # Three blocks for the next request: the two unretained free ones, then the retained block
    # whose retention ends first, the session's tail (block 1, hash 2).
    _serve(replica, TraceRequest(3000, 30, 0, (14, 15, 16)), 0)
    assert replica.pool.cached_hashes() == {1, 14, 15, 16}
    if replica.host is not None:
        # Demoted in eviction order, 13 and 12 take the two slots; the retained 2 then takes the
        # least recently used unretained block's (13) and keeps its retention.
        assert replica.host.eviction_order() == [12, 2]
        assert replica.host.retained_until(2) == pytest.approx(600.002)
    served = replica.serve((1, 2, 3), 30, 0, 60_000, 600)
    assert (served.cached_tokens, served.host_tokens) == (cached, from_host)


def test_an_unretained_block_never_pushes_a_retained_one_out_of_the_host_tier() -> None:
    replica = _replica(host_blocks=1)
    _serve(replica, TraceRequest(0, 40, 0, (1, 2, 3, 4), "agent"), 600)
    # Every pool block is retained; a 4-block request evicts them all, the tail first. The host
    # tier's one slot takes 4, then each earlier block, ending no later, pushes the last one out.
    _serve(replica, TraceRequest(1000, 40, 0, (5, 6, 7, 8)), 0)
    assert replica.host.eviction_order() == [1]
    # The next request's evictions (unretained) find only a retained block there: dropped.
    _serve(replica, TraceRequest(2000, 40, 0, (9, 10, 11, 12)), 0)
    assert replica.host.eviction_order() == [1]
    assert replica.host.retained_until(1) == pytest.approx(600.004)


def test_the_shared_tier_keeps_retained_blocks_last() -> None:
    tier = LruTier(3)
    for block_hash in (1, 2, 3):
        tier.put(block_hash)
    tier.retain([1, 9], until=100.0)  # 9 is not held: nothing to keep
    assert tier.lru_order() == [2, 3, 1]
    tier.put(4)
    tier.put(5)
    assert tier.lru_order() == [4, 5, 1]
    tier.retain([5, 4], until=50.0)  # equal ends: the order they were retained
    assert tier.lru_order() == [5, 4, 1]
    tier.put(6)  # every other block is retained: the new one is not kept
    assert tier.hit(1) and not tier.hit(6)
    assert tier.lru_order() == [5, 4, 1]
    tier.end_retention(60.0)  # 5 and 4 go on as if last used at 50 s
    assert tier.lru_order() == [5, 4, 1]
    tier.put(6)
    assert tier.lru_order() == [4, 6, 1]
    assert tier.num_retained == 1


def test_what_each_request_is_retained_for() -> None:
    config = ReplayConfig()
    session, plain = TraceRequest(0, 10, 0, (1,), "s"), TraceRequest(0, 10, 0, (1,))
    assert retention_seconds(session, config) == 600.0
    assert retention_seconds(plain, config) == 0.0
    # A request's own retention replaces the session default; 0 opts out of it.
    assert retention_seconds(TraceRequest(0, 10, 0, (1,), "s", retention_seconds=0), config) == 0.0
    assert retention_seconds(TraceRequest(0, 10, 0, (1,), retention_seconds=86400), config) == 86400.0
    assert retention_seconds(session, ReplayConfig(session_retention_s=300)) == 300.0
    assert retention_seconds(session, ReplayConfig(session_retention_s=0)) == 0.0
    assert (
        retention_seconds(
            TraceRequest(0, 10, 0, (1,), retention_seconds=86400), ReplayConfig(retention=False)
        )
        == 0.0
    )
    line = TraceRequest(5, 10, 1, (1,), "s", retention_seconds=0).to_json()
    assert json.loads(line)["retention_seconds"] == 0
    assert TraceRequest.from_json(line).retention_seconds == 0.0
    assert TraceRequest.from_json(plain.to_json()).retention_seconds is None
    for out_of_range in (-1, 86_401):  # the engine takes at most 24 hours
        with pytest.raises(ValueError, match="retention_seconds"):
            TraceRequest(0, 10, 0, (1,), retention_seconds=out_of_range)
    with pytest.raises(ValueError, match="session_retention_s"):
        ReplayConfig(session_retention_s=86_401)


def test_the_default_is_the_routers() -> None:
    default = RouterSettings.model_fields["session_cache_retention"].default
    assert DEFAULT_SESSION_RETENTION_SECONDS == RETENTION_SECONDS[SETTING_VALUES[default]] == 600


CONFIG = ReplayConfig(replicas=1, blocks_per_replica=4, block_tokens=10)
# 90 prompt tokens. Retained: the next turn hits 20 (the ideal: 20 too).
WITH = (70 * 600_000 + 20 * 100_000, 20 * 500_000)
WITHOUT = (90 * 600_000, 0)


def test_the_replay_reports_each_policy_with_and_without_retention() -> None:
    report = replay(TRACE, CONFIG)
    assert report.retained_requests == 2
    assert report.ideal_cached_token_ratio == pytest.approx(20 / 90)
    for policy, figures in report.policies.items():
        without = report.without_retention[policy]
        assert figures.cached_token_ratio == pytest.approx(20 / 90), policy
        assert without.cached_token_ratio == 0.0, policy
        assert (figures.cost_picousd, figures.saving_picousd) == WITH
        assert (without.cost_picousd, without.saving_picousd) == WITHOUT


def test_a_request_that_opts_out_is_not_retained() -> None:
    trace = [TraceRequest(0, 20, 0, (1, 2), "agent", retention_seconds=0), *BURST, NEXT_TURN]
    report = replay(trace, CONFIG, policies=("round-robin",))
    assert report.retained_requests == 1
    assert report.policies["round-robin"].cached_token_ratio == 0.0


def test_without_any_retention_the_second_replay_is_skipped() -> None:
    report = replay(
        TRACE, ReplayConfig(replicas=1, blocks_per_replica=4, block_tokens=10, session_retention_s=0)
    )
    assert report.retained_requests == 0
    assert report.without_retention is report.policies


def test_the_command_line_json(tmp_path) -> None:
    trace = tmp_path / "pause.jsonl"
    write_trace(trace, TRACE)
    args = [
        "replay",
        str(trace),
        "--json",
        "--replicas",
        "1",
        "--blocks-per-replica",
        "4",
        "--block-tokens",
        "10",
    ]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    document = json.loads(result.output)
    assert document["session_retention_seconds"] == 600.0
    assert document["retained_requests"] == 2
    figure_keys = {"cached_token_ratio", "max_load_over_mean", "cost_usd", "saving_usd"}
    for figures in document["policies"].values():
        assert set(figures) == {*figure_keys, "without_retention"}
        assert set(figures["without_retention"]) == figure_keys
        assert figures["cached_token_ratio"] == pytest.approx(20 / 90)
        assert (figures["cost_usd"], figures["saving_usd"]) == pytest.approx((WITH[0] / 1e12, WITH[1] / 1e12))
        assert figures["without_retention"]["cached_token_ratio"] == 0.0
        assert figures["without_retention"]["cost_usd"] == pytest.approx(WITHOUT[0] / 1e12)
    result = CliRunner().invoke(app, [*args, "--session-retention-seconds", "0"])
    document = json.loads(result.output)
    assert (document["session_retention_seconds"], document["retained_requests"]) == (0.0, 0)
    for figures in document["policies"].values():
        assert figures["cached_token_ratio"] == figures["without_retention"]["cached_token_ratio"] == 0.0
    assert CliRunner().invoke(app, [*args, "--session-retention-seconds", "-1"]).exit_code != 0
