"""The headroom rule and webhook signing, as pure functions."""

from __future__ import annotations

import random

from cachet.engine.v1 import engine_pb2
from cachet.router.dispatcher import HeadroomPolicy, ReplicaView, batch_slots, replica_slots
from cachet.router.webhooks import backoff_seconds, sign, verify

POLICY = HeadroomPolicy(max_running_fraction=0.75, min_free_kv_fraction=0.2)


def report(
    running: int = 0, waiting: int = 0, interactive_waiting: int = 0, free: int = 100
) -> engine_pb2.LoadReport:
    return engine_pb2.LoadReport(
        running_requests=running,
        waiting_requests=waiting,
        waiting_interactive_requests=interactive_waiting,
        free_kv_blocks=free,
        total_kv_blocks=100,
        max_running_requests=8,
        max_waiting_requests=16,
    )


def test_batch_work_fills_only_three_quarters_of_the_running_batch() -> None:
    assert replica_slots(report(), 0, POLICY) == 6
    assert replica_slots(report(running=4), 0, POLICY) == 2
    assert replica_slots(report(running=6), 0, POLICY) == 0
    assert replica_slots(report(running=8, waiting=3), 0, POLICY) == 0


def test_requests_in_flight_count_before_the_engine_reports_them() -> None:
    assert replica_slots(report(running=1), 4, POLICY) == 2  # estimate: 4 running


def test_low_free_kv_means_no_headroom() -> None:
    assert replica_slots(report(free=20), 0, POLICY) == 6
    assert replica_slots(report(free=19), 0, POLICY) == 0


def test_an_interactive_request_waiting_anywhere_stops_dispatch() -> None:
    assert batch_slots([ReplicaView(report(), 0, 0), ReplicaView(report(running=2), 0, 0)], POLICY) == 10
    waiting = report(interactive_waiting=1, waiting=1)
    assert batch_slots([ReplicaView(report(), 0, 0), ReplicaView(waiting, 0, 0)], POLICY) == 0


def test_an_engine_that_limits_batch_work_itself_gets_jobs_to_wait_beyond_it() -> None:
    # The engine seats batch work up to 6 running; 4 more jobs wait there for the next seat.
    limited = report(running=6)
    limited.max_batch_running_requests = 6
    assert replica_slots(limited, 0, POLICY) == 4
    limited.waiting_requests = 3
    assert replica_slots(limited, 0, POLICY) == 1
    assert replica_slots(limited, 0, HeadroomPolicy(prefetch=0)) == 0


def test_a_one_slot_engine_still_takes_batch_work() -> None:
    tiny = engine_pb2.LoadReport(max_running_requests=1, total_kv_blocks=10, free_kv_blocks=10)
    assert replica_slots(tiny, 0, POLICY) == 1


def test_signatures_verify_with_the_shared_secret_only() -> None:
    body = b'{"type":"batch.finished"}'
    header = sign("s3cret", 1_700_000_000, body)
    assert header.startswith("t=1700000000,v1=")
    assert verify("s3cret", header, body, now=1_700_000_010)
    assert not verify("other", header, body, now=1_700_000_010)
    assert not verify("s3cret", header, body + b" ", now=1_700_000_010)
    assert not verify("s3cret", header, body, now=1_700_000_000 + 301)  # replayed too late
    assert not verify("s3cret", "v1=abc", body)


def test_backoff_doubles_to_its_cap_with_half_jitter() -> None:
    rng = random.Random(7)
    for attempt, ceiling in [(1, 1.0), (2, 2.0), (3, 4.0), (10, 60.0)]:
        waits = [backoff_seconds(attempt, 1.0, 60.0, rng) for _ in range(200)]
        assert all(ceiling / 2 <= w <= ceiling for w in waits)
        assert max(waits) - min(waits) > ceiling / 4  # really jittered
