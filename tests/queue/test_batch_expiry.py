"""OpenAI batches past their completion window end as ``expired``: the store's sweep and the batch's view."""

from __future__ import annotations

import asyncio

import pytest
from settable_clock import Clock

from cachet.errors import InvalidArgument
from cachet.router.batch_queue import EXPIRED_RESULT, BatchQueue
from cachet.router.caller import Caller
from cachet.router.file_batches import FileBatches
from cachet.router.queue_store import BatchState, FileBatchRecord, JobState, QueueStore
from cachet.router.replica_set import ReplicaSet
from cachet.router.v1 import router_pb2

WINDOW_MS = 24 * 3600 * 1000
EXPIRED = EXPIRED_RESULT.SerializeToString()


def record(custom_ids: list[str]) -> FileBatchRecord:
    return FileBatchRecord("file-in", "/v1/chat/completions", "24h", {}, custom_ids, [])


async def test_a_batch_past_its_window_ends_its_unstarted_jobs_and_expires_when_the_started_one_ends(
    store: QueueStore, clock: Clock
) -> None:
    overdue = await store.create_batch(
        "acct-a", "m", [b"1", b"2", b"3"], "http://127.0.0.1:1/hook", record(["a", "b", "c"])
    )
    plain = await store.create_batch("acct-a", "m", [b"x"])  # a Workers AI batch has no window
    running = await store.lease("router-1", lease_seconds=WINDOW_MS)
    assert running is not None and running.batch_id == overdue
    clock.now_ms += WINDOW_MS - 1
    assert await store.expire_file_batches(WINDOW_MS, EXPIRED) == []
    view = await store.batch(overdue, "acct-a")
    assert view is not None and view.state is BatchState.RUNNING  # one millisecond short
    fresh = await store.create_batch("acct-a", "m", [b"y"], file_batch=record(["y"]))

    clock.now_ms += 1
    assert await store.expire_file_batches(WINDOW_MS, EXPIRED) == []  # its started job still runs
    view = await store.batch(overdue, "acct-a")
    assert view is not None and view.state is BatchState.EXPIRING and view.expired_at_ms == clock.now_ms
    assert view.job_states == [JobState.LEASED, JobState.CANCELLED, JobState.CANCELLED]
    assert view.results[1:] == [EXPIRED, EXPIRED]
    for untouched in (plain, fresh):
        other = await store.batch(untouched, "acct-a")
        assert other is not None and other.state is BatchState.QUEUED

    completion = await store.complete(running, b"ran")
    assert completion.stored and completion.batch_finished
    view = await store.batch(overdue, "acct-a")
    assert view is not None and view.state is BatchState.EXPIRED and view.results[0] == b"ran"
    due = await store.claim_webhook(hold_seconds=10)
    assert due is not None and due.batch_id == overdue
    assert await store.expire_file_batches(WINDOW_MS, EXPIRED) == []  # once only


async def test_an_idle_batch_expires_at_once_and_a_cancelled_one_stays_cancelled(
    store: QueueStore, clock: Clock
) -> None:
    idle = await store.create_batch("acct-a", "m", [b"1"], file_batch=record(["a"]))
    cancelled = await store.create_batch("acct-a", "m", [b"1"], file_batch=record(["a"]))
    await store.cancel_batch(cancelled, "acct-a", b"cancelled")
    clock.now_ms += WINDOW_MS
    assert await store.expire_file_batches(WINDOW_MS, EXPIRED) == [idle]
    assert (await store.batch(idle, "acct-a")).state is BatchState.EXPIRED
    assert (await store.batch(cancelled, "acct-a")).state is BatchState.CANCELLED


async def test_an_expired_batch_reads_as_openai_writes_it(store: QueueStore, clock: Clock) -> None:
    batches = FileBatches(store, BatchQueue(store, ReplicaSet([]), max_requests=10), max_lines=10)
    caller = Caller("acct-a", "")
    batch_id = await store.create_batch("acct-a", "m", [b"1", b"2"], file_batch=record(["first", "second"]))
    job = await store.lease("router-1", lease_seconds=WINDOW_MS)
    assert job is not None
    answer = router_pb2.QueuedResult(completion=router_pb2.ChatCompletion(id="c", model="m"))
    await store.complete(job, answer.SerializeToString())
    clock.now_ms += WINDOW_MS
    assert await store.expire_file_batches(WINDOW_MS, EXPIRED) == [batch_id]

    batch = await batches.get(router_pb2.GetBatchRequest(batch_id=batch_id), caller)
    assert batch.status == router_pb2.OPEN_AI_BATCH_STATUS_EXPIRED
    # Lines that never ran are in the error file, not counted as failed (as for a cancel).
    assert batch.expired_at == clock.now_ms // 1000 and (batch.completed, batch.failed) == (1, 0)
    assert batch.output_file_id and batch.error_file_id
    errors = await batches.get_file_content(router_pb2.GetFileRequest(file_id=batch.error_file_id), caller)
    assert [(line.custom_id, line.line_error.code) for line in errors.batch_results.lines] == [
        ("second", "batch_expired")
    ]
    with pytest.raises(InvalidArgument, match="status 'expired'"):
        await batches.cancel(router_pb2.GetBatchRequest(batch_id=batch_id), caller)


async def test_the_dispatcher_sweeps_overdue_batches_and_announces_the_ended_ones(
    store: QueueStore, clock: Clock
) -> None:
    from cachet.router.dispatcher import Dispatcher, HeadroomPolicy

    batch_id = await store.create_batch("acct-a", "m", [b"1"], file_batch=record(["a"]))
    clock.now_ms += WINDOW_MS
    ended: list[str] = []
    # No replicas: no headroom, so the dispatcher leases nothing and never needs its pipeline.
    dispatcher = Dispatcher(
        store,
        pipeline=None,  # type: ignore[arg-type]
        replicas=ReplicaSet([]),
        policy=HeadroomPolicy(),
        lease_seconds=30,
        poll_seconds=0.01,
        max_attempts=3,
        on_batch_finished=ended.append,
        expiry_sweep_seconds=0.01,
    )
    dispatcher.start()
    try:
        for _ in range(500):
            if ended:
                break
            await asyncio.sleep(0.01)
    finally:
        await dispatcher.stop()
    assert ended == [batch_id]
    assert (await store.batch(batch_id, "acct-a")).state is BatchState.EXPIRED
