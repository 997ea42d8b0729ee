"""A replica's load between reports: our own in-flight requests count before the engine shows them."""

from __future__ import annotations

from cachet.engine.v1 import engine_pb2
from cachet.router.placement import ReplicaLoad
from cachet.router.replica_set import estimated_load


def report(
    running: int = 0,
    waiting: int = 0,
    max_running: int = 2,
    max_waiting: int = 3,
    running_batch: int = 0,
    waiting_batch: int = 0,
) -> engine_pb2.LoadReport:
    return engine_pb2.LoadReport(
        running_requests=running,
        waiting_requests=waiting,
        max_running_requests=max_running,
        max_waiting_requests=max_waiting,
        running_batch_requests=running_batch,
        waiting_batch_requests=waiting_batch,
    )


def test_the_report_stands_when_it_already_shows_our_requests() -> None:
    assert estimated_load("a", report(running=2, waiting=1), in_flight=3) == ReplicaLoad("a", 2, 1, 2, 3)


def test_unreported_requests_fill_the_batch_then_the_queue() -> None:
    assert estimated_load("a", report(), in_flight=1) == ReplicaLoad("a", 1, 0, 2, 3)
    load = estimated_load("a", report(running=1), in_flight=3)
    assert (load.running, load.waiting) == (2, 1)
    assert load.saturated  # full batch with a queue behind it, before any report says so


def test_other_routers_requests_in_the_report_are_kept() -> None:
    load = estimated_load("a", report(running=2, waiting=2), in_flight=1)
    assert (load.running, load.waiting) == (2, 2)


def test_unknown_batch_limit_counts_everything_as_running() -> None:
    load = estimated_load("a", report(max_running=0), in_flight=4)
    assert (load.running, load.waiting) == (4, 0)


def test_our_unreported_jobs_are_the_first_of_ours_to_wait() -> None:
    # Four of ours (three of them jobs) on a two-seat replica that reported nothing yet:
    # the interactive one and a job run, two jobs wait.
    load = estimated_load("a", report(), in_flight=4, in_flight_batch=3)
    assert (load.running, load.waiting, load.batch_running, load.batch_waiting) == (2, 2, 1, 2)
    assert not load.saturated  # an interactive arrival would preempt the running job


def test_reported_jobs_are_kept_when_ours_are_fewer() -> None:
    load = estimated_load("a", report(running=2, waiting=1, running_batch=2, waiting_batch=1), in_flight=0)
    assert (load.batch_running, load.batch_waiting) == (2, 1)
    assert not load.saturated
    interactive_full = estimated_load("a", report(running=2, waiting=1), in_flight=0)
    assert interactive_full.saturated


def test_our_request_the_engine_queued_but_had_not_seated_is_counted_once() -> None:
    # Reported just after it arrived, before the step that seats it: 0 running, 1 waiting.
    # That one is ours: a one-seat replica holding only it is not full.
    one_seat = report(waiting=1, max_running=1, max_waiting=1)
    load = estimated_load("a", one_seat, in_flight=1, in_flight_at_report=1)
    assert (load.running, load.waiting) == (1, 0)
    assert not load.saturated
    # Sent after that report came in: the report does not show it, so the waiting one is another's.
    load = estimated_load("a", one_seat, in_flight=1, in_flight_at_report=0)
    assert (load.running, load.waiting) == (1, 1)
    assert load.saturated


def test_ours_that_ended_since_the_report_no_longer_count() -> None:
    load = estimated_load("a", report(running=2, waiting=1), in_flight=1, in_flight_at_report=3)
    assert (load.running, load.waiting) == (1, 0)
    jobs = report(running=2, running_batch=2)
    load = estimated_load(
        "a", jobs, in_flight=1, in_flight_batch=1, in_flight_at_report=2, in_flight_batch_at_report=2
    )
    assert (load.running, load.batch_running, load.batch_waiting) == (1, 1, 0)
