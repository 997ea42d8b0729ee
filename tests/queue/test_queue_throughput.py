"""The queue's cost per operation does not grow with the backlog, the faster paths keep its order,
and a finished job's slot is lent again at once (not at the next load report, nor the next poll).

Costs are counted, not timed: SQLite calls a progress handler every N virtual-machine
instructions, so the work one ``lease`` does is a number that is the same on a busy
machine and an idle one. (The wall-clock figures live in ``python -m bench --only queue``.)
"""

from __future__ import annotations

import sqlite3
import time
from itertools import pairwise
from pathlib import Path

import grpc
import pytest
from service_processes import ENGINE_SERVER_BUILT, TINY_MODEL_ID, CachetStack
from settable_clock import Clock

from cachet.common.v1 import common_pb2
from cachet.engine.v1 import engine_pb2
from cachet.models.tiny import write_tiny_model
from cachet.router.dispatcher import HeadroomPolicy, replica_slots
from cachet.router.queue_store import QueueStore
from cachet.router.sqlite_queue_store import SqliteQueueStore
from cachet.router.v1 import router_pb2, router_pb2_grpc

HEADROOM = HeadroomPolicy(max_running_fraction=0.75, min_free_kv_fraction=0.2)


async def fill(store: QueueStore, jobs: int, accounts: int = 4, per_batch: int = 1000) -> None:
    for start in range(0, jobs, per_batch):
        await store.create_batch(f"acct-{start // per_batch % accounts}", "m", [b"body"] * per_batch)


async def instructions_per_lease(store: SqliteQueueStore, leases: int = 8) -> float:
    """SQLite VM instructions (in steps of 100) spent by each of ``leases`` leases."""
    steps = 0

    def count() -> int:
        nonlocal steps
        steps += 1
        return 0  # 0: carry on

    # The test reaches the store's one connection to count its work; nothing else touches it.
    store._worker.connection.set_progress_handler(count, 100)
    try:
        for _ in range(leases):
            assert await store.lease("router-1", lease_seconds=30) is not None
    finally:
        store._worker.connection.set_progress_handler(None, 100)
    return steps / leases


async def test_a_lease_costs_the_same_with_a_backlog_twenty_times_larger(tmp_path: Path) -> None:
    small = SqliteQueueStore(tmp_path / "small.sqlite3")
    large = SqliteQueueStore(tmp_path / "large.sqlite3")
    try:
        await fill(small, 1_000)
        await fill(large, 20_000)
        small_cost = await instructions_per_lease(small)
        large_cost = await instructions_per_lease(large)
    finally:
        await small.close()
        await large.close()
    # Sorting every runnable row (the old plan) made this ratio about 20.
    assert large_cost <= 2 * small_cost + 10, (small_cost, large_cost)


async def test_submitting_costs_the_same_with_a_backlog_twenty_times_larger(tmp_path: Path) -> None:
    store = SqliteQueueStore(tmp_path / "queue.sqlite3")
    steps = 0

    def count() -> int:
        nonlocal steps
        steps += 1
        return 0

    try:
        costs = []
        for backlog in (1_000, 19_000):
            await fill(store, backlog)
            store._worker.connection.set_progress_handler(count, 100)
            steps = 0
            await store.create_batch("acct-x", "m", [b"body"] * 10)
            store._worker.connection.set_progress_handler(None, 100)
            costs.append(steps)
    finally:
        await store.close()
    # MAX(seq) over every job (the old way) made the second cost about 20 times the first.
    assert costs[1] <= 2 * costs[0] + 10, costs


async def test_jobs_keep_arrival_order_across_batches(store: QueueStore) -> None:
    first = await store.create_batch("acct-a", "m", [b"a0", b"a1"])
    second = await store.create_batch("acct-a", "m", [b"b0"])
    leased = [await store.lease("router-1", lease_seconds=30) for _ in range(3)]
    assert [job.request_id for job in leased if job] == [f"{first}-0", f"{first}-1", f"{second}-0"]
    assert await store.lease("router-1", lease_seconds=30) is None


async def test_a_lapsed_lease_older_than_queued_work_goes_first(store: QueueStore, clock: Clock) -> None:
    batch = await store.create_batch("acct-a", "m", [b"one", b"two"])
    lapsed = await store.lease("router-1", lease_seconds=10)
    assert lapsed is not None and lapsed.request_id == f"{batch}-0"
    clock.now_ms += 10_000
    again = await store.lease("router-2", lease_seconds=10)
    assert again is not None and again.request_id == f"{batch}-0" and again.attempt == 2
    following = await store.lease("router-2", lease_seconds=10)
    assert following is not None and following.request_id == f"{batch}-1"


async def test_round_robin_wraps_to_an_account_that_only_has_a_lapsed_lease(
    store: QueueStore, clock: Clock
) -> None:
    """Account a's only runnable job is a lapsed lease; after serving b, the lease wraps around to it."""
    a_batch = await store.create_batch("acct-a", "m", [b"a"])
    b_batch = await store.create_batch("acct-b", "m", [b"b0", b"b1"])
    taken = await store.lease("router-1", lease_seconds=10)
    assert taken is not None and taken.request_id == f"{a_batch}-0"
    clock.now_ms += 10_000
    order = []
    last = "acct-a"
    for _ in range(3):
        job = await store.lease("router-2", lease_seconds=10, after_account=last)
        assert job is not None
        order.append(job.request_id)
        last = job.account_id
    assert order == [f"{b_batch}-0", f"{a_batch}-0", f"{b_batch}-1"]


# ------------------------------------------------------------- headroom estimate


def load_report(running: int = 0, waiting: int = 0) -> engine_pb2.LoadReport:
    return engine_pb2.LoadReport(
        running_requests=running,
        waiting_requests=waiting,
        free_kv_blocks=100,
        total_kv_blocks=100,
        max_running_requests=8,
        max_waiting_requests=16,
    )


def test_our_jobs_that_ended_after_the_report_free_their_slots_at_once() -> None:
    """The report (6 running) predates 4 of our 6 requests ending: 6 - 2 slots, not 6 - 6."""
    assert replica_slots(load_report(running=6), 2, HEADROOM, in_flight_at_report=6) == 4


def test_other_routers_requests_in_the_report_still_count() -> None:
    """6 running, of which only our 2: the other 4 are someone else's and hold their slots."""
    assert replica_slots(load_report(running=6), 2, HEADROOM, in_flight_at_report=2) == 0
    assert replica_slots(load_report(running=3, waiting=1), 1, HEADROOM, in_flight_at_report=1) == 2


def test_requests_sent_after_the_report_count_before_the_engine_shows_them() -> None:
    assert replica_slots(load_report(running=1), 4, HEADROOM, in_flight_at_report=1) == 2


# ------------------------------------------------------------- real processes


@pytest.fixture(scope="module")
def serial_stack(tmp_path_factory: pytest.TempPathFactory):
    """One engine and a router that runs one queued job at a time and polls the queue only every 10 s."""
    if not ENGINE_SERVER_BUILT:
        pytest.skip("the engine server (cachet.engine.main) is not built yet")
    root = tmp_path_factory.mktemp("queue-serial")
    router_env = {"CACHET_ROUTER_QUEUE_POLL_SECONDS": "10", "CACHET_ROUTER_BATCH_MAX_IN_FLIGHT": "1"}
    stack = CachetStack(root, write_tiny_model(root / TINY_MODEL_ID)).start(engines=1, router_env=router_env)
    try:
        yield stack
    finally:
        stack.stop()
        print(stack.logs())


def test_the_next_job_starts_when_one_ends_not_at_the_next_poll(serial_stack: CachetStack) -> None:
    jobs = 6
    sampling = common_pb2.SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    request = router_pb2.QueueRequestsRequest(
        model=TINY_MODEL_ID,
        requests=[
            router_pb2.QueuedRequest(
                completion=router_pb2.CompletionRequest(
                    model=TINY_MODEL_ID, prompt_token_ids=[1000 + i, 2000, 3000], sampling=sampling
                )
            )
            for i in range(jobs)
        ],
    )
    with grpc.insecure_channel(serial_stack.address("router")) as channel:
        stub = router_pb2_grpc.InferenceServiceStub(channel)
        batch_id = stub.QueueRequests(request, timeout=30).request_id
        deadline = time.monotonic() + 300
        while (
            stub.GetQueuedBatch(router_pb2.GetQueuedBatchRequest(request_id=batch_id), timeout=30).status
            != router_pb2.BATCH_STATUS_DONE
        ):
            assert time.monotonic() < deadline, "queued batch not done after 300 s"
            time.sleep(0.2)
    queue_file = serial_stack.log_dir / "router-data" / "queue.sqlite3"
    with sqlite3.connect(f"file:{queue_file}?mode=ro", uri=True) as db:
        # A lease lasts queue_lease_seconds (30 s by default) from when it was taken; these
        # jobs end long before their first renewal, so expiry - 30 s is when each started.
        rows = db.execute(
            "SELECT lease_expires_at_ms - 30000, finished_at_ms FROM jobs WHERE batch_id = ? ORDER BY position",
            (batch_id,),
        ).fetchall()
    gaps_ms = [next_start - finished for (_, finished), (next_start, _) in pairwise(rows)]
    # Waiting for the 10 s poll instead would make each gap anywhere in 0-10 s.
    assert all(0 <= gap < 2_000 for gap in gaps_ms), gaps_ms
