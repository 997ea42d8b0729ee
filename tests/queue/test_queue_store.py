"""The queue store on SQLite and on PostgreSQL: leases, expiry, fairness, exactly-once completion, webhooks."""

from __future__ import annotations

import asyncio
from pathlib import Path

from prometheus_client import REGISTRY
from queue_backends import QueueBackend
from settable_clock import Clock

from cachet.router.queue_store import BatchState, Completion, QueueStore
from cachet.router.sqlite_queue_store import SqliteQueueStore


async def test_a_lease_expires_and_the_job_is_taken_again(store: QueueStore, clock: Clock) -> None:
    batch = await store.create_batch("acct-a", "m", [b"one"])
    first = await store.lease("router-1", lease_seconds=10)
    assert first is not None and first.request_id == f"{batch}-0" and first.attempt == 1
    assert await store.lease("router-2", lease_seconds=10) is None  # held
    clock.now_ms += 9_999
    assert await store.lease("router-2", lease_seconds=10) is None  # still held
    clock.now_ms += 1
    second = await store.lease("router-2", lease_seconds=10)
    assert second is not None and second.request_id == first.request_id and second.attempt == 2
    # The first owner lost its lease: it can no longer renew or release it.
    assert not await store.renew(first, 10)
    assert not await store.release(first)
    assert await store.renew(second, 10)


async def test_renewal_keeps_a_running_job(store: QueueStore, clock: Clock) -> None:
    await store.create_batch("acct-a", "m", [b"one"])
    job = await store.lease("router-1", lease_seconds=10)
    assert job is not None
    clock.now_ms += 8_000
    assert await store.renew(job, 10)
    clock.now_ms += 8_000  # 16 s after the lease, 8 s after the renewal
    assert await store.lease("router-2", lease_seconds=10) is None


async def test_release_requeues_without_counting_an_attempt(store: QueueStore) -> None:
    await store.create_batch("acct-a", "m", [b"one"])
    job = await store.lease("router-1", lease_seconds=10)
    assert job is not None and await store.release(job)
    again = await store.lease("router-1", lease_seconds=10)
    assert again is not None and again.attempt == 1


async def test_completion_is_stored_once_and_finishes_the_batch_once(store: QueueStore, clock: Clock) -> None:
    batch = await store.create_batch("acct-a", "m", [b"one", b"two"], webhook_url="http://127.0.0.1:1/hook")
    one = await store.lease("router-1", lease_seconds=1)
    two = await store.lease("router-1", lease_seconds=1)
    assert one is not None and two is not None and (one.position, two.position) == (0, 1)
    clock.now_ms += 1_000
    retried = await store.lease("router-2", lease_seconds=10)  # one's lease lapsed: taken again
    assert retried is not None and retried.request_id == one.request_id
    first = await store.complete(retried, b"result from router-2")
    late = await store.complete(one, b"result from router-1")
    assert (first.stored, first.batch_finished) == (True, False)
    assert (late.stored, late.batch_finished) == (False, False)
    view = await store.batch(batch, "acct-a")
    assert view is not None and view.state is BatchState.RUNNING
    assert view.results == [b"result from router-2", None]
    # A poller that wants results only at the end reads the states alone meanwhile.
    polled = await store.batch(batch, "acct-a", results_once_finished=True)
    assert polled is not None and polled.results == [] and polled.job_states == ["done", "leased"]
    last = await store.complete(two, b"two done")
    assert (last.stored, last.batch_finished) == (True, True)
    for results_once_finished in (False, True):
        view = await store.batch(batch, "acct-a", results_once_finished=results_once_finished)
        assert view is not None and view.state is BatchState.DONE
        assert view.results == [b"result from router-2", b"two done"]
    assert view.webhook_state == "pending"
    assert await store.counts() == {"done": 2}


async def test_completions_arriving_together_share_a_commit_and_keep_their_own_outcomes(
    store: QueueStore, queue_backend: QueueBackend
) -> None:
    bodies = [str(i).encode() for i in range(30)]
    batch = await store.create_batch("acct-a", "m", bodies)
    jobs = [job for _ in bodies if (job := await store.lease("router-1", lease_seconds=10)) is not None]
    assert len(jobs) == len(bodies)
    commits_before = REGISTRY.get_sample_value("cachet_router_queue_completions_per_commit_count") or 0
    outcomes = await asyncio.gather(
        *(store.complete(job, job.body) for job in jobs[1:]),
        store.complete(jobs[1], b"a second attempt"),
        # A write that fails (this value cannot be stored) fails alone, not the group with it.
        store.complete(jobs[0], object()),  # type: ignore[arg-type]
        return_exceptions=True,
    )
    *stored, again, failed = outcomes
    assert all(isinstance(o, Completion) and o.stored for o in stored)
    assert isinstance(again, Completion) and not again.stored
    assert isinstance(failed, queue_backend.write_error)
    assert sum(o.batch_finished for o in stored) == 0  # job 0 is still out
    assert await store.counts() == {"done": 29, "leased": 1}
    # 31 completions arrived before the first was written: they shared one commit, or two.
    commits = REGISTRY.get_sample_value("cachet_router_queue_completions_per_commit_count") - commits_before
    assert 1 <= commits <= 2
    last = await store.complete(jobs[0], jobs[0].body)
    assert last.stored and last.batch_finished
    view = await store.batch(batch, "acct-a")
    assert view is not None and view.state is BatchState.DONE and view.results == bodies


async def test_a_batch_completed_in_one_group_finishes_once_and_keeps_first_results(
    store: QueueStore,
) -> None:
    bodies = [str(i).encode() for i in range(10)]
    batch = await store.create_batch("acct-a", "m", bodies, webhook_url="http://127.0.0.1:1/hook")
    jobs = await store.lease_many("router-1", lease_seconds=10, limit=len(bodies))
    assert len(jobs) == len(bodies)
    outcomes = await asyncio.gather(
        *(store.complete(job, job.body) for job in jobs), store.complete(jobs[3], b"a second attempt")
    )
    *firsts, again = outcomes
    assert all(o.stored for o in firsts) and not again.stored and not again.batch_finished
    assert sum(o.batch_finished for o in outcomes) == 1
    view = await store.batch(batch, "acct-a")
    assert view is not None and view.state is BatchState.DONE and view.results == bodies
    due = await store.claim_webhook(hold_seconds=10)
    assert due is not None and due.batch_id == batch


async def test_two_dispatchers_racing_complete_each_job_exactly_once(queue_backend: QueueBackend) -> None:
    """Two stores (two routers) on one database, leases that lapse at once: every job ends with one result."""
    stores = [await queue_backend.open(None), await queue_backend.open(None)]
    jobs = 40
    batch = await stores[0].create_batch("acct-a", "m", [str(i).encode() for i in range(jobs)])
    stored: list[str] = []
    finished: list[str] = []

    async def dispatcher(store: QueueStore, name: str) -> None:
        while True:
            # A zero-length lease: the other dispatcher may take the same job at once (at-least-once).
            job = await store.lease(name, lease_seconds=0)
            if job is None:
                return
            await asyncio.sleep(0)
            outcome = await store.complete(job, f"{name}:{job.body.decode()}".encode())
            if outcome.stored:
                stored.append(job.request_id)
            if outcome.batch_finished:
                finished.append(name)

    try:
        await asyncio.gather(dispatcher(stores[0], "d1"), dispatcher(stores[1], "d2"))
        assert sorted(stored) == sorted(f"{batch}-{i}" for i in range(jobs))
        assert len(finished) == 1
        view = await stores[1].batch(batch, "acct-a")
        assert view is not None and view.state is BatchState.DONE
        assert [r.split(b":")[1] for r in view.results if r] == [str(i).encode() for i in range(jobs)]
    finally:
        for store in stores:
            await store.close()


async def test_leases_go_round_robin_across_accounts(store: QueueStore) -> None:
    await store.create_batch("acct-b", "m", [b"b0", b"b1", b"b2"])
    await store.create_batch("acct-a", "m", [b"a0", b"a1"])
    await store.create_batch("acct-c", "m", [b"c0"])
    order: list[bytes] = []
    last = ""
    while (job := await store.lease("r", lease_seconds=60, after_account=last)) is not None:
        order.append(job.body)
        last = job.account_id
    assert order == [b"a0", b"b0", b"c0", b"a1", b"b1", b"b2"]


async def test_lease_many_takes_what_single_leases_would(tmp_path: Path, queue_backend: QueueBackend) -> None:
    bodies = {"acct-b": [b"b0", b"b1", b"b2"], "acct-a": [b"a0", b"a1"], "acct-c": [b"c0"]}
    # The single leases run on a SQLite file of their own, the reference order.
    singles, together = SqliteQueueStore(tmp_path / "singles.sqlite3"), await queue_backend.open(None)
    try:
        for store in (singles, together):
            for account, lines in bodies.items():
                await store.create_batch(account, "m", lines)
        one_by_one, after = [], "acct-a"
        for _ in range(4):
            job = await singles.lease("r", lease_seconds=60, after_account=after)
            assert job is not None
            one_by_one.append(job.body)
            after = job.account_id
        first = await together.lease_many("r", lease_seconds=60, after_account="acct-a", limit=4)
        assert [job.body for job in first] == one_by_one == [b"b0", b"c0", b"a0", b"b1"]
        # Fewer than asked once the queue runs dry, none after that.
        rest = await together.lease_many("r", lease_seconds=60, after_account=first[-1].account_id, limit=5)
        assert [job.body for job in rest] == [b"a1", b"b2"]
        assert await together.lease_many("r", lease_seconds=60, limit=5) == []
    finally:
        await singles.close()
        await together.close()


async def test_sqlite_lease_many_is_one_commit(tmp_path: Path) -> None:
    store = SqliteQueueStore(tmp_path / "queue.sqlite3")
    try:
        for account in ("acct-a", "acct-b"):
            await store.create_batch(account, "m", [b"x", b"y"])
        statements: list[str] = []
        store._worker.connection.set_trace_callback(statements.append)
        assert len(await store.lease_many("r", lease_seconds=60, limit=4)) == 4
        store._worker.connection.set_trace_callback(None)
        assert statements.count("COMMIT") == 1
    finally:
        await store.close()


async def test_another_account_cannot_see_a_batch(store: QueueStore) -> None:
    batch = await store.create_batch("acct-a", "m", [b"one"])
    assert await store.batch(batch, "acct-b") is None
    assert await store.batch("batch-nope", "acct-a") is None
    view = await store.batch(batch, "acct-a")
    assert view is not None and view.state is BatchState.QUEUED and view.results == [None]


async def test_a_batch_survives_reopening_the_store(queue_backend: QueueBackend) -> None:
    first = await queue_backend.open(None)
    batch = await first.create_batch("acct-a", "m", [b"one"])
    await first.close()
    second = await queue_backend.open(None)
    try:
        job = await second.lease("r", lease_seconds=5)
        assert job is not None and job.batch_id == batch and job.body == b"one"
    finally:
        await second.close()


async def test_webhook_claims_and_attempts(store: QueueStore, clock: Clock) -> None:
    batch = await store.create_batch("acct-a", "m", [b"one"], webhook_url="http://127.0.0.1:1/hook")
    assert await store.claim_webhook(5) is None  # not finished yet
    job = await store.lease("r", lease_seconds=5)
    assert job is not None
    await store.complete(job, b"done")
    due = await store.claim_webhook(5)
    assert due is not None and due.batch_id == batch and due.attempts == 0 and due.account_id == "acct-a"
    assert await store.claim_webhook(5) is None  # claimed: not handed out twice
    await store.record_webhook_attempt(
        batch, 500, "HTTP 500", delivered=False, retry_at_ms=clock.now_ms + 100
    )
    clock.now_ms += 100
    due = await store.claim_webhook(5)
    assert due is not None and due.attempts == 1
    await store.record_webhook_attempt(batch, 204, "", delivered=True, retry_at_ms=None)
    clock.now_ms += 10_000
    assert await store.claim_webhook(5) is None
    attempts = await store.webhook_attempts(batch)
    assert [(a.attempt, a.http_status) for a in attempts] == [(1, 500), (2, 204)]
    view = await store.batch(batch, "acct-a")
    assert view is not None and view.webhook_state == "delivered"
