"""The queue store's cancel, uploaded files and OpenAI batch records, on SQLite and on PostgreSQL."""

from __future__ import annotations

from cachet.router.queue_store import BatchState, FileBatchRecord, JobState, QueueStore

CANCELLED = b"cancelled-result"


async def test_cancel_ends_unstarted_jobs_and_the_running_one_finishes_the_batch(store: QueueStore) -> None:
    batch = await store.create_batch("acct-a", "m", [b"one", b"two", b"three"], "http://127.0.0.1:1/hook")
    running = await store.lease("router-1", lease_seconds=30)
    assert running is not None and running.position == 0
    cancellation = await store.cancel_batch(batch, "acct-a", CANCELLED)
    assert cancellation is not None
    assert (cancellation.cancelled_jobs, cancellation.batch_finished) == (2, False)
    view = await store.batch(batch, "acct-a")
    assert view is not None and view.state is BatchState.CANCELLING
    assert view.job_states == [JobState.LEASED, JobState.CANCELLED, JobState.CANCELLED]
    assert view.results[1:] == [CANCELLED, CANCELLED]
    # Nothing of the batch can be leased any more.
    assert await store.lease("router-2", lease_seconds=30) is None
    completion = await store.complete(running, b"ran")
    assert completion.stored and completion.batch_finished
    view = await store.batch(batch, "acct-a")
    assert view is not None and view.state is BatchState.CANCELLED and view.results[0] == b"ran"
    # Its webhook is armed once, as for a batch that finished.
    due = await store.claim_webhook(hold_seconds=10)
    assert due is not None and due.batch_id == batch


async def test_cancelling_an_idle_batch_finishes_it_and_a_second_cancel_changes_nothing(
    store: QueueStore,
) -> None:
    batch = await store.create_batch("acct-a", "m", [b"one", b"two"])
    first = await store.cancel_batch(batch, "acct-a", CANCELLED)
    assert first is not None and (first.cancelled_jobs, first.batch_finished) == (2, True)
    again = await store.cancel_batch(batch, "acct-a", CANCELLED)
    assert again is not None and (again.cancelled_jobs, again.batch_finished) == (0, False)
    view = await store.batch(batch, "acct-a")
    assert view is not None and view.state is BatchState.CANCELLED
    assert await store.counts() == {"cancelled": 2}


async def test_another_account_can_neither_cancel_nor_read(store: QueueStore) -> None:
    batch = await store.create_batch("acct-a", "m", [b"one"])
    assert await store.cancel_batch(batch, "acct-b", CANCELLED) is None
    assert await store.batch(batch, "acct-b") is None
    view = await store.batch(batch, "acct-a")
    assert view is not None and view.state is BatchState.QUEUED


async def test_files_belong_to_their_account(store: QueueStore) -> None:
    stored = await store.put_file("acct-a", "in.jsonl", "batch", b'{"custom_id": "x"}\n')
    assert stored.size == 19 and stored.file_id.startswith("file-")
    assert await store.file(stored.file_id, "acct-a") == stored
    assert await store.file_content(stored.file_id, "acct-a") == b'{"custom_id": "x"}\n'
    assert await store.file(stored.file_id, "acct-b") is None
    assert await store.file_content(stored.file_id, "acct-b") is None


def record(custom_ids: list[str], rejected: list[tuple[str, str, str, int]] | None = None) -> FileBatchRecord:
    return FileBatchRecord("file-in", "/v1/chat/completions", "24h", {"k": "v"}, custom_ids, rejected or [])


async def test_file_batches_page_newest_first(store: QueueStore) -> None:
    ids = [await store.create_batch("acct-a", "m", [b"x"], file_batch=record(["a"])) for _ in range(5)]
    await store.create_batch("acct-b", "m", [b"x"], file_batch=record(["a"]))
    await store.create_batch("acct-a", "m", [b"x"])  # a plain queued batch is not listed
    page, more = await store.file_batch_ids("acct-a", "", 2)
    assert (page, more) == ([ids[4], ids[3]], True)
    page, more = await store.file_batch_ids("acct-a", ids[3], 2)
    assert (page, more) == ([ids[2], ids[1]], True)
    page, more = await store.file_batch_ids("acct-a", ids[1], 2)
    assert (page, more) == ([ids[0]], False)
    stored = await store.file_batch(ids[0], "acct-a")
    assert stored == record(["a"])
    assert await store.file_batch(ids[0], "acct-b") is None


async def test_a_batch_whose_every_line_was_refused_is_finished_at_once(store: QueueStore) -> None:
    refused = [("a", "invalid_request", "bad", 1)]
    batch = await store.create_batch("acct-a", "", [], "http://127.0.0.1:1/hook", record([], refused))
    view = await store.batch(batch, "acct-a")
    assert view is not None and view.state is BatchState.DONE and view.results == []
    stored = await store.file_batch(batch, "acct-a")
    assert stored is not None and stored.rejected == refused
    due = await store.claim_webhook(hold_seconds=10)
    assert due is not None and due.batch_id == batch
