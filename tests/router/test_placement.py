"""Placement rules, exactly: session stickiness, bounded-load spill, failover, scoring, admission."""

from __future__ import annotations

import pytest

from cachet.errors import ResourceExhausted, Unavailable
from cachet.router.placement import (
    PlacementPolicy,
    ReplicaLoad,
    bounded_load_capacity,
    choose_replica,
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


def test_session_sticks_to_its_home_regardless_of_cached_prefix() -> None:
    session = session_homed_on(B)
    replicas = [idle(A), idle(B), idle(C)]
    placement = choose_replica(replicas, {A: 4096}, session_id=session, all_addresses=ALL)
    assert (placement.address, placement.reason) == (B, "session")
    # Same answer every time, and under moderate load on the home replica.
    loaded = [idle(A, 1), idle(B, 2), idle(C, 1)]
    assert choose_replica(loaded, {}, session_id=session, all_addresses=ALL).address == B


def test_bounded_load_capacity() -> None:
    # total load 3 + this request = 4 over 2 replicas, × 1.25 = 2.5 → 3.
    assert bounded_load_capacity([idle(A, 3), idle(B, 0)], 0.25) == 3
    assert bounded_load_capacity([idle(A), idle(B)], 0.25) == 1


def test_session_spills_to_its_next_rendezvous_replica_when_home_is_over_the_bound() -> None:
    session = session_homed_on(A)
    order = rendezvous_order(session, ALL)
    # Home holds 4 of 5 requests: capacity = ceil(1.25 × 6 / 3) = 3, so 4 + 1 > 3 spills.
    loads = {order[0]: 4, order[1]: 1, order[2]: 0}
    replicas = [idle(address, running=load, max_running=16) for address, load in loads.items()]
    placement = choose_replica(replicas, {}, session_id=session, all_addresses=ALL)
    # The spill follows rendezvous order (second choice), not the least loaded replica.
    assert (placement.address, placement.reason) == (order[1], "session_spill")


def test_session_skips_a_second_choice_that_is_also_over_the_bound() -> None:
    session = session_homed_on(A)
    order = rendezvous_order(session, ALL)
    loads = {order[0]: 3, order[1]: 3, order[2]: 0}  # capacity = ceil(1.25 × 7 / 3) = 3
    replicas = [idle(address, running=load, max_running=16) for address, load in loads.items()]
    tight = PlacementPolicy(load_epsilon=0.25)
    assert (
        choose_replica(replicas, {}, session_id=session, all_addresses=ALL, policy=tight).address == order[2]
    )


def test_session_fails_over_to_longest_prefix_when_home_is_gone() -> None:
    session = session_homed_on(A)
    others = [address for address in rendezvous_order(session, ALL) if address != A]
    # The prefix lives on the rendezvous *last* choice: failover must follow the prefix, not the order.
    prefix_holder = others[1]
    replicas = [idle(address) for address in others]  # A is not available
    placement = choose_replica(replicas, {prefix_holder: 512}, session_id=session, all_addresses=ALL)
    assert (placement.address, placement.reason) == (prefix_holder, "session_failover")


def test_session_fails_over_when_home_is_saturated() -> None:
    session = session_homed_on(C)
    replicas = [idle(A), idle(B, running=1), idle(C, running=8, waiting=2)]
    # With 128 tokens a request, B's 160 cached tokens outweigh its one running request.
    policy = PlacementPolicy(load_penalty_tokens=128)
    placement = choose_replica(
        replicas, {B: 160, C: 4096}, session_id=session, all_addresses=ALL, policy=policy
    )
    assert (placement.address, placement.reason) == (B, "session_failover")


def test_session_fails_over_when_home_was_tried_already() -> None:
    session = session_homed_on(A)
    replicas = [idle(A), idle(B), idle(C)]
    placement = choose_replica(replicas, {C: 64}, session_id=session, all_addresses=ALL, exclude={A})
    assert (placement.address, placement.reason) == (C, "session_failover")


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
        choose_replica(replicas, {}, session_id="s", all_addresses=(A, B))


def test_no_available_replica_is_unavailable() -> None:
    with pytest.raises(Unavailable):
        choose_replica([], {})
    with pytest.raises(Unavailable):
        choose_replica([idle(A)], {}, exclude={A})
