"""Replay figures: the ideal ratio and every policy on small hand-computed traces, then a generated one."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from cachet.router.placement import rendezvous_order
from cachet.tools.agent_traces import AgentTraceShape, agent_trace
from cachet.tools.lru_tier import LruTier
from cachet.tools.replay import (
    POLICIES,
    ReplayConfig,
    ideal_cached_tokens,
    max_over_mean,
    publish,
    replay,
)
from cachet.tools.simulated_replica import ServiceTimeModel, SimulatedReplica
from cachet.tools.trace import TraceRequest

ADDRESSES = ["replica-0", "replica-1"]
# Rendezvous homes on two replicas (checked below): session "c" on replica-0, "a" on replica-1.
HOME_0, HOME_1 = "c", "a"


def request(t: int, hash_ids: list[int], input_length: int, session: str = "") -> TraceRequest:
    # No output and 1 s between requests: each is done within ms, so every load is 0.
    return TraceRequest(t * 1000, input_length, 0, tuple(hash_ids), session)


def test_ideal_ratio_on_five_requests() -> None:
    trace = [
        request(0, [1, 2, 3], 25),  # cold: 0
        request(1, [1, 2, 4], 30),  # blocks 1, 2: 20
        request(2, [5, 7], 20),  # another prefix: 0
        request(3, [1, 2, 3], 25),  # all three, but the last block has 5 tokens: 25
        request(4, [1, 8], 12),  # block 1 only: 10
    ]
    assert ideal_cached_tokens(trace, block_tokens=10) == 55
    report = replay(trace, ReplayConfig(block_tokens=10), policies=())
    assert report.input_tokens == 112
    assert report.ideal_cached_token_ratio == pytest.approx(55 / 112)


# Two replicas of 3 blocks of 10 tokens. Hand-computed replays below, LRU lists head (next evicted) first.
EXACT_TRACE = [
    request(0, [1, 2], 20, HOME_0),
    request(1, [3, 4], 20, HOME_1),
    request(2, [1, 2, 5], 25, HOME_0),
    request(3, [3, 4, 6], 30, HOME_1),
    request(4, [8, 9, 10], 30, HOME_0),  # a 3-block prompt evicts everything else on its replica
    request(5, [1, 2], 20, HOME_0),
    request(6, [3], 10),  # no session
]
EXACT_CONFIG = ReplayConfig(replicas=2, blocks_per_replica=3, block_tokens=10, seed=0)
# Total prompt tokens 155. The one unlimited cache hits r2 (20), r3 (20), r5 (20), r6 (10).
EXACT_IDEAL = 70 / 155


def test_the_exact_trace_sessions_live_where_the_test_assumes() -> None:
    assert rendezvous_order(HOME_0, ADDRESSES)[0] == "replica-0"
    assert rendezvous_order(HOME_1, ADDRESSES)[0] == "replica-1"
    # The random policy's draws for seed 0, used in the hand computation below.
    draw = random.Random(0)
    assert [draw.choice(ADDRESSES) for _ in EXACT_TRACE] == ["replica-1"] * 2 + ["replica-0"] + [
        "replica-1"
    ] * 4


@pytest.fixture(scope="module")
def exact_report():
    return replay(EXACT_TRACE, EXACT_CONFIG)


def test_exact_ideal(exact_report) -> None:
    assert exact_report.ideal_cached_token_ratio == pytest.approx(EXACT_IDEAL)


def test_exact_affinity(exact_report) -> None:
    # c starts on replica-0 (rendezvous order breaks the tie), a on replica-1 (no session KV there).
    # replica-0: r0 cold; r2 hits 1,2 (20); r4 evicts 5,2,1; r5 misses (0), evicting 10,9.
    # replica-1: r1 cold; r3 hits 3,4 (20). r6 has no session: the index says replica-1 holds
    # block 3, so the score sends it there (10).
    figures = exact_report.policies["affinity"]
    assert figures.cached_token_ratio == pytest.approx(50 / 155)
    assert figures.computed_tokens == (20 + 5 + 30 + 20, 20 + 10 + 0)
    assert figures.requests == (4, 3)
    assert figures.max_load_over_mean == pytest.approx(75 / 52.5)
    # 105 uncached tokens at $0.60/M and 50 cached at $0.10/M; caching saved 50 × $0.50/M.
    assert (figures.cost_picousd, figures.saving_picousd) == (105 * 600_000 + 50 * 100_000, 50 * 500_000)
    # The two sessions start on replicas holding no session KV (c: rendezvous order on a tie).
    assert figures.reasons == {"session_new": 2, "session": 4, "score": 1}


def test_exact_cache_aware_herds_onto_the_first_replica(exact_report) -> None:
    # Nothing cached anywhere and equal loads: ties go to replica-0, which then always
    # holds the longest prefix (or ties again). Only r2 hits: r1 evicted block 2, so 1 block (10).
    figures = exact_report.policies["cache-aware"]
    assert figures.cached_token_ratio == pytest.approx(10 / 155)
    assert figures.computed_tokens == (145, 0)
    assert figures.max_load_over_mean == pytest.approx(2.0)


def test_exact_round_robin(exact_report) -> None:
    # replica-0 gets r0, r2 (20), r4, r6; replica-1 gets r1, r3 (20), r5.
    figures = exact_report.policies["round-robin"]
    assert figures.cached_token_ratio == pytest.approx(40 / 155)
    assert figures.computed_tokens == (20 + 5 + 30 + 10, 20 + 10 + 20)
    assert figures.requests == (4, 3)
    assert figures.max_load_over_mean == pytest.approx(65 / 57.5)


def test_exact_random(exact_report) -> None:
    # Draws 1,1,0,1,1,1,1. replica-1: r0 cold; r1 evicts 2 (the unnamed block goes first, then
    # the tail of r0); r3 hits 3,4 (20) and evicts 1; r4, r5, r6 miss. replica-0: r2 cold.
    figures = exact_report.policies["random"]
    assert figures.cached_token_ratio == pytest.approx(20 / 155)
    assert figures.computed_tokens == (25, 110)
    assert figures.max_load_over_mean == pytest.approx(110 / 67.5)


def test_json_has_exactly_the_promised_keys(exact_report) -> None:
    document = exact_report.to_json()
    assert set(document) == {
        "ideal_cached_token_ratio",
        "session_retention_seconds",
        "retained_requests",
        "policies",
    }
    # Six of the seven requests have a session, so the router's default retains them.
    assert (document["session_retention_seconds"], document["retained_requests"]) == (600.0, 6)
    assert list(document["policies"]) == list(POLICIES)
    figure_keys = {"cached_token_ratio", "max_load_over_mean", "cost_usd", "saving_usd"}
    for figures in document["policies"].values():
        assert set(figures) == {*figure_keys, "without_retention"}
        assert set(figures["without_retention"]) == figure_keys
    assert document["policies"]["affinity"]["cost_usd"] == pytest.approx(68e-6)
    assert document["policies"]["affinity"]["saving_usd"] == pytest.approx(25e-6)


def test_without_sessions_affinity_is_cache_aware() -> None:
    trace = [request(t, list(r.hash_ids), r.input_length) for t, r in enumerate(EXACT_TRACE)]
    report = replay(trace, EXACT_CONFIG)
    assert report.policies["affinity"].cached_token_ratio == report.policies["cache-aware"].cached_token_ratio
    assert report.policies["affinity"].reasons == {"score": len(trace)}


def test_in_flight_requests_are_the_load_placement_sees() -> None:
    # 10 prompt tokens at 10 tokens/s + 2 output tokens at 1 token/s: 3 s in flight.
    replica = SimulatedReplica(
        "r",
        num_blocks=4,
        block_tokens=10,
        service=ServiceTimeModel(prefill_tokens_per_s=10, decode_tokens_per_s=1),
    )
    replica.serve([1], 10, 2, now_ms=0)
    replica.serve([1], 10, 2, now_ms=1000)  # cached: 0 s prefill + 2 s decode, done at 3000
    assert replica.load(2999).running == 2
    assert replica.load(3000).running == 0
    assert not replica.load(3000).saturated


def test_the_index_mirrors_every_replica_pool() -> None:
    from cachet.cache.prefix_index import PrefixIndex

    draw = random.Random(7)
    replica = SimulatedReplica("r", num_blocks=6, block_tokens=4, service=ServiceTimeModel())
    index = PrefixIndex()
    for t in range(200):
        prefix = draw.choice([[1, 2], [1, 3], [4]])
        hash_ids = prefix + [draw.randrange(100, 110) for _ in range(draw.randrange(5))]
        replica.serve(hash_ids, 4 * len(hash_ids), 1, now_ms=t)
        publish(index, "r", replica.take_events())
        replica.pool.check_invariants()
        index.check_invariants()
        assert {
            h for h in replica.pool.cached_hashes() if index.holds("r", h)
        } == replica.pool.cached_hashes()
        assert index.replica_blocks("r") == len(replica.pool.cached_hashes())


def test_a_prompt_longer_than_the_pool_caches_the_prefix_that_fits() -> None:
    replica = SimulatedReplica("r", num_blocks=2, block_tokens=10, service=ServiceTimeModel())
    assert replica.serve([1, 2, 3, 4], 40, 0, now_ms=0).cached_tokens == 0
    assert replica.pool.cached_hashes() == {1, 2}
    served = replica.serve([1, 2, 3, 4], 40, 0, now_ms=1)
    assert (served.cached_tokens, served.computed_tokens) == (20, 20)


def test_evicted_blocks_are_demoted_to_the_host_tier_and_loaded_back() -> None:
    replica = SimulatedReplica("r", num_blocks=2, block_tokens=10, service=ServiceTimeModel(), host_blocks=2)
    replica.serve([1, 2], 20, 0, now_ms=0)
    # The pool evicts the first prompt tail first (2, then 1): both are demoted, in that order.
    replica.serve([3, 4], 20, 0, now_ms=1)
    assert replica.host.eviction_order() == [2, 1]
    served = replica.serve([1, 2, 5], 25, 0, now_ms=2)
    # 1 and 2 come back from the host (the pool has room for two blocks: 5 is not stored). As in
    # the engine, their slots are locked while the step copies them back, so 4 and 3, evicted to
    # make room, find no slot and are dropped.
    assert (served.cached_tokens, served.host_tokens, served.shared_tokens) == (20, 20, 0)
    assert replica.host.eviction_order() == [1, 2]
    assert replica.pool.cached_hashes() == {1, 2}
    assert (replica.cached_tokens, replica.host_tokens) == (20, 20)


def test_every_replica_reads_what_any_replica_wrote_to_the_shared_tier() -> None:
    shared = LruTier(3)
    service = ServiceTimeModel()
    writer = SimulatedReplica("a", num_blocks=4, block_tokens=10, service=service, shared=shared)
    reader = SimulatedReplica("b", num_blocks=4, block_tokens=10, service=service, shared=shared)
    writer.serve([7, 8], 20, 0, now_ms=0)
    assert shared.lru_order() == [7, 8]
    served = reader.serve([7, 8, 9, 6], 40, 0, now_ms=1)
    assert (served.cached_tokens, served.shared_tokens) == (20, 20)
    # Loaded blocks are not written again; computed ones are, and the least recent goes.
    assert shared.lru_order() == [8, 9, 6]


def test_tiers_raise_the_cached_ratio_and_lower_the_cost_when_kv_is_short(agent_trace_128) -> None:
    short = ReplayConfig(blocks_per_replica=128)
    tiered = replace(short, host_blocks_per_replica=1024, shared_blocks=2048)
    plain = replay(agent_trace_128, short, policies=("affinity",)).policies["affinity"]
    more = replay(agent_trace_128, tiered, policies=("affinity",)).policies["affinity"]
    assert more.cached_token_ratio > plain.cached_token_ratio + 0.1
    assert more.host_cached_tokens > 0 and more.shared_cached_tokens > 0
    assert more.cost_picousd < plain.cost_picousd and more.saving_picousd > plain.saving_picousd


def test_max_over_mean() -> None:
    assert max_over_mean([1, 1, 1, 1]) == 1.0
    assert max_over_mean([4, 0, 0, 0]) == 4.0
    assert max_over_mean([0, 0]) == 1.0


# 128 sessions x 8 turns on 4 replicas with room for every live conversation (2,048 blocks each).
AGENT_SHAPE = AgentTraceShape(sessions=128, turns=8)


@pytest.fixture(scope="module")
def agent_trace_128() -> list[TraceRequest]:
    return agent_trace(AGENT_SHAPE, seed=0)


def test_on_agent_traffic_cache_aware_placement_beats_round_robin(agent_trace_128) -> None:
    report = replay(agent_trace_128, ReplayConfig(blocks_per_replica=2048))
    ideal = report.ideal_cached_token_ratio
    floor = report.policies["round-robin"].cached_token_ratio
    assert ideal > 0.8
    assert report.policies["cache-aware"].cached_token_ratio >= 0.95 * ideal
    assert report.policies["affinity"].cached_token_ratio >= 0.95 * ideal
    for policy in ("affinity", "cache-aware"):
        assert report.policies[policy].cached_token_ratio > floor + 0.1
    assert report.policies["random"].cached_token_ratio < report.policies["affinity"].cached_token_ratio
    # Affinity spreads the work; round-robin spreads requests evenly.
    assert report.policies["affinity"].max_load_over_mean < 1.3
    assert max_over_mean(report.policies["round-robin"].requests) < 1.01


def test_too_little_capacity_costs_hits(agent_trace_128) -> None:
    small = replay(agent_trace_128, ReplayConfig(blocks_per_replica=128), policies=("affinity",))
    large = replay(agent_trace_128, ReplayConfig(blocks_per_replica=2048), policies=("affinity",))
    assert small.policies["affinity"].cached_token_ratio < large.policies["affinity"].cached_token_ratio - 0.1


def test_an_unknown_policy_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown policy"):
        replay(EXACT_TRACE, EXACT_CONFIG, policies=("fastest",))
