"""Placement rules, exactly: sessions by prefix, home and KV footprint, scoring, admission."""

from __future__ import annotations

import pytest

from cachet.errors import ResourceExhausted, Unavailable
from cachet.router.placement import (
    Placement,
    PlacementPolicy,
    ReplicaLoad,
    choose_replica,
    prefix_value,
    rendezvous_order,
    rendezvous_weight,
)

A, B, C = "10.0.0.1:50061", "10.0.0.2:50061", "10.0.0.3:50061"
ALL = (A, B, C)


def idle(
    address: str, running: int = 0, waiting: int = 0, max_running: int = 8, max_waiting: int = 4
) -> ReplicaLoad:
    return ReplicaLoad(address, running, waiting, max_running, max_waiting)


def session_homed_on(home: str, addresses: tuple[str, ...] = ALL) -> str:
    """A session id whose first rendezvous choice is ``home`` (found by search, so tests stay exact)."""
    return next(f"s{i}" for i in range(10_000) if rendezvous_order(f"s{i}", addresses)[0] == home)


# --- saturation ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("running", "waiting", "saturated"),
    [
        (7, 0, False),  # room in the batch
        (8, 0, False),  # batch full, nobody queued: a slot frees within a step
        (8, 1, True),  # batch full and a queue behind it
        (3, 4, True),  # waiting queue full: the engine would refuse
        (3, 3, False),
    ],
)
def test_saturation_rule(running: int, waiting: int, saturated: bool) -> None:
    assert idle(A, running, waiting).saturated is saturated


@pytest.mark.parametrize(
    ("running", "waiting", "batch_running", "batch_waiting", "saturated"),
    [
        (8, 1, 1, 0, False),  # a job holds a seat: the waiting interactive request takes it
        (8, 2, 0, 2, False),  # only jobs wait behind a full batch of interactive requests
        (8, 2, 0, 1, True),  # an interactive request waits behind interactive ones
        (3, 4, 3, 4, True),  # a full waiting queue refuses anything, jobs or not
    ],
)
def test_queued_jobs_never_saturate_a_replica_for_interactive_traffic(
    running: int, waiting: int, batch_running: int, batch_waiting: int, saturated: bool
) -> None:
    load = ReplicaLoad(
        A,
        running,
        waiting,
        max_running=8,
        max_waiting=4,
        batch_running=batch_running,
        batch_waiting=batch_waiting,
    )
    assert load.saturated is saturated


def test_unknown_limits_never_saturate() -> None:
    assert not ReplicaLoad(A, running=100, waiting=100, max_running=0, max_waiting=0).saturated


# --- rendezvous hashing ----------------------------------------------------------------------


def test_rendezvous_weight_is_stable_and_depends_on_both_inputs() -> None:
    assert rendezvous_weight("s", A) == rendezvous_weight("s", A)
    assert rendezvous_weight("s", A) != rendezvous_weight("s", B)
    assert rendezvous_weight("s", A) != rendezvous_weight("t", A)


def test_rendezvous_moves_only_sessions_homed_on_a_removed_replica() -> None:
    sessions = [f"session-{i}" for i in range(300)]
    before = {s: rendezvous_order(s, ALL)[0] for s in sessions}
    after = {s: rendezvous_order(s, (A, B))[0] for s in sessions}
    moved = {s for s in sessions if before[s] != after[s]}
    assert moved == {s for s in sessions if before[s] == C}
    # And the three replicas each get a fair share (rendezvous spreads sessions).
    for address in ALL:
        assert 60 < sum(home == address for home in before.values()) < 140


# --- sessions --------------------------------------------------------------------------------


def test_session_stays_home_while_home_holds_its_prefix() -> None:
    # B holds the session's 4,096 cached tokens; two more requests there cost 1,024 < 4,096.
    replicas = [idle(A), idle(B, running=2), idle(C)]
    placement = choose_replica(replicas, {B: 4096, A: 512}, session_id="s", session_home=B)
    assert (placement.address, placement.reason) == (B, "session")


def test_session_follows_its_prefix_rather_than_a_hash() -> None:
    # The session's prefix is on C whatever its rendezvous order says: the index wins.
    session = session_homed_on(A)
    placement = choose_replica([idle(A), idle(B), idle(C)], {C: 2048}, session_id=session, session_home=C)
    assert placement.address == C


def test_session_moves_only_when_the_queue_at_home_costs_more_than_its_prefix() -> None:
    policy = PlacementPolicy(load_penalty_tokens=512)
    # Home B: 2,048 cached − 2 × 512 = 1,024; A: 0. A is behind: stay.
    stays = choose_replica(
        [idle(A), idle(B, running=2)], {B: 2048}, session_id="s", session_home=B, policy=policy
    )
    assert (stays.address, stays.reason) == (B, "session")
    # Two more requests at home: 2,048 − 4 × 512 = 0, level with A: the lighter replica takes it.
    moves = choose_replica(
        [idle(A), idle(B, running=4, max_running=16)],
        {B: 2048},
        session_id="s",
        session_home=B,
        policy=policy,
    )
    assert (moves.address, moves.reason) == (A, "session_move")


def test_with_the_index_silent_a_session_stays_home_unless_home_is_saturated() -> None:
    # Nothing cached anywhere (index down): B is busier, yet the session stays.
    placement = choose_replica([idle(A), idle(B, running=5)], {}, session_id="s", session_home=B)
    assert (placement.address, placement.reason) == (B, "session")
    moved = choose_replica([idle(A), idle(B, running=8, waiting=1)], {}, session_id="s", session_home=B)
    assert (moved.address, moved.reason) == (A, "session_move")


def test_a_session_whose_prefix_is_gone_from_home_goes_to_the_lighter_replica() -> None:
    # Every replica holds only the shared 512-token system prompt: home B is no better.
    shared = {A: 512, B: 512, C: 512}
    replicas = [idle(A), idle(B, running=1), idle(C)]
    placement = choose_replica(replicas, shared, session_id="s", session_home=B, footprints={A: 900, C: 100})
    assert (placement.address, placement.reason) == (C, "session_move")


def test_a_new_session_goes_to_the_least_loaded_then_where_sessions_hold_the_least_kv() -> None:
    replicas = [idle(A), idle(B), idle(C)]
    footprints = {A: 90_000, B: 10_000, C: 40_000}
    placement = choose_replica(replicas, {}, session_id="new", footprints=footprints)
    assert (placement.address, placement.reason) == (B, "session_new")
    busy_b = [idle(A), idle(B, running=1), idle(C)]
    assert choose_replica(busy_b, {}, session_id="new", footprints=footprints).address == C


def test_a_new_session_gives_up_a_shared_prefix_to_balance_kv_but_not_more() -> None:
    replicas = [idle(A), idle(B)]
    footprints = {A: 500_000}
    # A holds the 12,000-token system prompt every session shares; B holds nothing yet.
    assert choose_replica(replicas, {A: 12_000}, session_id="new", footprints=footprints).address == B
    # 40,000 cached tokens on A are more than a new session gives up (32,768 by default).
    assert choose_replica(replicas, {A: 40_000}, session_id="new", footprints=footprints).address == A


def test_equal_footprints_fall_back_to_the_rendezvous_order() -> None:
    session = session_homed_on(C)
    placement = choose_replica([idle(A), idle(B), idle(C)], {}, session_id=session)
    assert (placement.address, placement.reason) == (C, "session_new")


def test_a_session_whose_home_is_gone_or_saturated_or_tried_moves() -> None:
    replicas = [idle(A), idle(B, running=1), idle(C, running=8, waiting=2)]
    # Home C is saturated: B's 2,048 cached tokens outweigh its one running request.
    placement = choose_replica(replicas, {B: 2048, C: 4096}, session_id="s", session_home=C)
    assert (placement.address, placement.reason) == (B, "session_move")
    # Home A was tried already.
    tried = choose_replica([idle(A), idle(B), idle(C)], {C: 64}, session_id="s", session_home=A, exclude={A})
    assert tried.reason == "session_move"
    # Home is not reporting at all.
    gone = choose_replica([idle(B), idle(C)], {C: 2048}, session_id="s", session_home=A)
    assert (gone.address, gone.reason) == (C, "session_move")


# --- scoring without a session ---------------------------------------------------------------


def test_scoring_prefers_the_longest_cached_prefix() -> None:
    replicas = [idle(A), idle(B), idle(C)]
    assert choose_replica(replicas, {A: 16, B: 256, C: 32}).address == B


def test_scoring_trades_prefix_against_load() -> None:
    policy = PlacementPolicy(load_penalty_tokens=100)
    # B: 300 − 3×100 = 0; A: 0 − 0 = 0 → tie → least loaded (A).
    replicas = [idle(A), idle(B, running=3)]
    assert choose_replica(replicas, {B: 300}, policy=policy).address == A
    # One more cached block on B tips it: 316 − 300 = 16 > 0.
    assert choose_replica(replicas, {B: 316}, policy=policy).address == B
    # C: 250 − 100 = 150 beats B: 316 − 300 = 16.
    replicas.append(idle(C, running=1))
    assert choose_replica(replicas, {B: 316, C: 250}, policy=policy).address == C


def test_scoring_ties_go_to_least_loaded_then_lowest_address() -> None:
    policy = PlacementPolicy(load_penalty_tokens=0)
    assert choose_replica([idle(A, 2), idle(B, 1), idle(C, 1)], {}, policy=policy).address == B
    assert choose_replica([idle(C), idle(B), idle(A)], {}).address == A


def test_scoring_never_picks_a_saturated_replica_whatever_its_prefix() -> None:
    replicas = [idle(A, running=8, waiting=1), idle(B, running=7)]
    placement = choose_replica(replicas, {A: 100_000})
    assert (placement.address, placement.reason) == (B, "score")


# --- admission -------------------------------------------------------------------------------


def test_all_saturated_is_resource_exhausted_at_once() -> None:
    replicas = [idle(A, running=8, waiting=4), idle(B, running=8, waiting=1)]
    with pytest.raises(ResourceExhausted) as refused:
        choose_replica(replicas, {A: 64}, policy=PlacementPolicy(retry_after_seconds=3))
    assert refused.value.retry_after_seconds == 3
    with pytest.raises(ResourceExhausted):
        choose_replica(replicas, {}, session_id="s", session_home=A)


def test_no_available_replica_is_unavailable() -> None:
    with pytest.raises(Unavailable):
        choose_replica([], {})
    with pytest.raises(Unavailable):
        choose_replica([idle(A)], {}, exclude={A})


# --- KV tiers --------------------------------------------------------------------------------


def tiered(holdings: dict[str, tuple[int, int, int]]) -> dict[str, float]:
    """Cached tokens per replica from (engine, host, shared) tokens, as the router weighs the index's
    answer."""
    return {address: prefix_value(*tokens, PlacementPolicy()) for address, tokens in holdings.items()}


def test_a_prefix_in_the_host_tier_beats_no_prefix_and_loses_to_the_pool() -> None:
    replicas = [idle(A), idle(B), idle(C)]
    # A holds nothing; B holds the prompt's 2,048 tokens in host memory only.
    assert choose_replica(replicas, tiered({B: (0, 2048, 0)})).address == B
    # C holds the same tokens in its pool: the copy back B needs makes C the better choice.
    assert choose_replica(replicas, tiered({B: (0, 2048, 0), C: (2048, 0, 0)})).address == C
    # The shared tier ranks below the host tier, and above nothing.
    assert choose_replica(replicas, tiered({A: (0, 0, 2048), B: (0, 2048, 0)})).address == B
    assert choose_replica([idle(A), idle(B)], tiered({B: (0, 0, 2048)})).address == B
    # A longer prefix in a lower tier still beats a shorter one in the pool.
    assert choose_replica(replicas, tiered({B: (1024, 1024, 0), C: (1536, 0, 0)})).address == B


def test_a_session_follows_its_prefix_into_the_host_tier() -> None:
    # The session's home lost its prefix from every tier; another replica kept it in host memory.
    session = session_homed_on(A)
    chosen = choose_replica(
        [idle(A), idle(B), idle(C)], tiered({B: (0, 4096, 0)}), session_id=session, session_home=A
    )
    assert chosen == Placement(B, "session_move")


def test_tier_weights_come_from_the_policy() -> None:
    policy = PlacementPolicy(host_tier_weight=0.5, shared_tier_weight=0.25)
    assert prefix_value(100, 100, 100, policy) == 100 + 50 + 25
    assert prefix_value(100, 100, 100, PlacementPolicy()) == pytest.approx(100 + 98 + 97)
    # With the host tier worth half, one request of load (512 tokens) outweighs 1,000 host tokens.
    replicas = [idle(A), idle(B, running=1)]
    cached = {B: prefix_value(0, 1000, 0, policy)}
    assert choose_replica(replicas, cached, policy=policy).address == A
    assert choose_replica(replicas, {B: prefix_value(0, 1000, 0, PlacementPolicy())}).address == B
