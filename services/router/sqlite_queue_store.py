"""The durable async queue on SQLite (the embedded default): one file, one worker thread.

The contract is ``cachet.router.queue_store``'s. SQLite is blocking, so, as in the
usage ledger, every call runs on one worker thread that owns the one connection
(WAL, FULL sync, busy timeout); the event loop only awaits. Writes that must be
atomic run inside ``BEGIN IMMEDIATE``, which takes the write lock up front, so two
routers sharing the file cannot both lease the same job.
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import TypeVar

from cachet.durable_sqlite import open_durable_sqlite
from cachet.router.api_keys import API_KEY_COLUMNS, ApiKey, api_key_from_row, api_key_row
from cachet.router.completion_groups import CompletionGroups, PendingCompletion
from cachet.router.queue_records import (
    BatchView,
    Cancellation,
    Completion,
    DueWebhook,
    FileBatchRecord,
    Job,
    JobState,
    ResponseItem,
    StoredFile,
    StoredResponse,
    WebhookAttempt,
    batch_state,
)

T = TypeVar("T")

SCHEMA_VERSION = 1

_SCHEMA = """
CREATE TABLE IF NOT EXISTS batches (
    batch_id TEXT PRIMARY KEY,
    account_id TEXT NOT NULL,
    model TEXT NOT NULL,
    webhook_url TEXT NOT NULL,
    jobs INTEGER NOT NULL,
    created_at_ms INTEGER NOT NULL,
    -- Set once, by the complete() that finished the last job.
    finished_at_ms INTEGER,
    -- '' (no webhook), 'pending', 'delivered' or 'failed'.
    webhook_state TEXT NOT NULL DEFAULT '',
    -- When the next delivery attempt is due; doubles as the sender's lease.
    webhook_due_at_ms INTEGER NOT NULL DEFAULT 0
);
CREATE TABLE IF NOT EXISTS jobs (
    request_id TEXT PRIMARY KEY,
    batch_id TEXT NOT NULL REFERENCES batches (batch_id),
    position INTEGER NOT NULL,
    account_id TEXT NOT NULL,
    -- Serialized cachet.router.v1.QueuedRequest.
    body BLOB NOT NULL,
    state TEXT NOT NULL DEFAULT 'queued',
    -- Global arrival order: rowids of one batch are consecutive.
    seq INTEGER NOT NULL,
    lease_owner TEXT NOT NULL DEFAULT '',
    lease_expires_at_ms INTEGER NOT NULL DEFAULT 0,
    attempts INTEGER NOT NULL DEFAULT 0,
    -- Serialized cachet.router.v1.QueuedResult, written once.
    result BLOB,
    finished_at_ms INTEGER,
    UNIQUE (batch_id, position)
);
-- The dispatcher's question, "what is runnable, per account, oldest first?".
CREATE INDEX IF NOT EXISTS jobs_runnable ON jobs (state, account_id, seq);
-- Each completion's question, "is any job of this batch left to end?".
CREATE INDEX IF NOT EXISTS jobs_by_batch_state ON jobs (batch_id, state);
CREATE TABLE IF NOT EXISTS webhook_attempts (
    batch_id TEXT NOT NULL REFERENCES batches (batch_id),
    attempt INTEGER NOT NULL,
    at_ms INTEGER NOT NULL,
    -- HTTP status of the answer; 0 when there was none (connection failed, timed out).
    http_status INTEGER NOT NULL,
    error TEXT NOT NULL,
    PRIMARY KEY (batch_id, attempt)
);
CREATE TABLE IF NOT EXISTS batch_cancellations (
    batch_id TEXT PRIMARY KEY REFERENCES batches (batch_id),
    cancelled_at_ms INTEGER NOT NULL
);
-- OpenAI batches whose completion window ended before they did.
CREATE TABLE IF NOT EXISTS batch_expirations (
    batch_id TEXT PRIMARY KEY REFERENCES batches (batch_id),
    expired_at_ms INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS files (
    file_id TEXT PRIMARY KEY,
    account_id TEXT NOT NULL,
    filename TEXT NOT NULL,
    purpose TEXT NOT NULL,
    created_at_ms INTEGER NOT NULL,
    content BLOB NOT NULL
);
CREATE TABLE IF NOT EXISTS file_batches (
    batch_id TEXT PRIMARY KEY REFERENCES batches (batch_id),
    account_id TEXT NOT NULL,
    input_file_id TEXT NOT NULL,
    endpoint TEXT NOT NULL,
    completion_window TEXT NOT NULL,
    -- JSON object, as the client gave it.
    metadata TEXT NOT NULL,
    -- JSON list: the custom_id of each job, by position.
    custom_ids TEXT NOT NULL,
    -- JSON list of [custom_id, code, message, line] for lines refused before running.
    rejected TEXT NOT NULL
);
-- Listing an account's batches newest first, paged by rowid.
CREATE INDEX IF NOT EXISTS file_batches_by_account ON file_batches (account_id);
-- Managed API keys (api_keys.py): the key's SHA-256, never the key. Times in Unix ms, 0: never.
CREATE TABLE IF NOT EXISTS api_keys (
    key_id TEXT PRIMARY KEY,
    key_hash TEXT NOT NULL,
    account_id TEXT NOT NULL,
    name TEXT NOT NULL,
    created_at_ms INTEGER NOT NULL,
    expires_at_ms INTEGER NOT NULL DEFAULT 0,
    revoked_at_ms INTEGER NOT NULL DEFAULT 0,
    last_used_at_ms INTEGER NOT NULL DEFAULT 0,
    -- Limits; 0: none.
    requests_per_minute INTEGER NOT NULL DEFAULT 0,
    tokens_per_minute INTEGER NOT NULL DEFAULT 0,
    monthly_budget_picousd INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS api_keys_by_account ON api_keys (account_id, created_at_ms);
-- The managed key a batch was queued with: its jobs count against that key's limits when they run.
CREATE TABLE IF NOT EXISTS batch_api_keys (
    batch_id TEXT PRIMARY KEY REFERENCES batches (batch_id),
    key_id TEXT NOT NULL
);
-- OpenAI Responses' stored responses: the JSON as answered (the bridge's; kept unread) and
-- the session a follow-up runs under. Times in Unix seconds, as OpenAI's created_at.
CREATE TABLE IF NOT EXISTS stored_responses (
    account_id TEXT NOT NULL,
    response_id TEXT NOT NULL,
    created_at INTEGER NOT NULL,
    session_id TEXT NOT NULL,
    response BLOB NOT NULL,
    PRIMARY KEY (account_id, response_id)
);
-- A stored response's input items, one row each in conversation order, so a page of
-- input_items reads only its rows.
CREATE TABLE IF NOT EXISTS stored_response_items (
    account_id TEXT NOT NULL,
    response_id TEXT NOT NULL,
    position INTEGER NOT NULL,
    item_id TEXT NOT NULL,
    item BLOB NOT NULL,
    PRIMARY KEY (account_id, response_id, position)
);
"""

# A job may run when it is queued, or leased by an owner whose lease has lapsed.
_RUNNABLE = "(state = 'queued' OR (state = 'leased' AND lease_expires_at_ms <= :now))"

# The lease asks its two questions once per kind of runnable job rather than over
# _RUNNABLE: an OR across states makes SQLite collect and sort every runnable row,
# so a lease cost grew with the backlog (34 ms at 100,000 queued jobs). Split, each
# query starts at its first entry of the (state, account_id, seq) index; the lapsed
# branch walks only leased rows, which are as many as the jobs in flight.
_FIRST_ACCOUNT = """
SELECT MIN(account_id) FROM (
    SELECT MIN(account_id) AS account_id FROM jobs WHERE state = 'queued' AND account_id {bound}
    UNION ALL
    SELECT MIN(account_id) FROM jobs
    WHERE state = 'leased' AND lease_expires_at_ms <= :now AND account_id {bound}
)"""
_NEXT_ACCOUNT = _FIRST_ACCOUNT.format(bound="> :after")
_ANY_ACCOUNT = _FIRST_ACCOUNT.format(bound=">= ''")  # every text sorts at or after ''
_OLDEST_JOB = (
    "SELECT seq, request_id, batch_id, position, body, attempts FROM jobs"
    " WHERE account_id = :account AND {runnable} ORDER BY seq LIMIT 1"
)
_OLDEST_QUEUED_JOB = _OLDEST_JOB.format(runnable="state = 'queued'")
_OLDEST_LAPSED_JOB = _OLDEST_JOB.format(runnable="state = 'leased' AND lease_expires_at_ms <= :now")

# Jobs that may still run (the others have a result stored).
_NOT_ENDED = f"('{JobState.QUEUED}', '{JobState.LEASED}')"


def _now_ms() -> int:
    return int(time.time() * 1000)


def _connect(path: Path) -> sqlite3.Connection:
    return open_durable_sqlite(path, _SCHEMA, SCHEMA_VERSION, what="queue", check_same_thread=False)


class SqliteQueueStore:
    """The queue's durable state in one SQLite file; every method is safe to call concurrently."""

    def __init__(self, path: Path, clock_ms: Callable[[], int] = _now_ms) -> None:
        self.path = path
        self._clock_ms = clock_ms
        # One thread owns the connection: SQLite allows one writer anyway.
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="queue-store")
        self._db = self._executor.submit(_connect, path).result()
        self.location = str(path)
        self._completions = CompletionGroups(self._write_completions)

    async def close(self) -> None:
        await self._completions.drain()
        await self._run(self._db.close)
        self._executor.shutdown(wait=True)

    async def _run(self, function: Callable[[], T]) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._executor, function)

    def _transaction(self, function: Callable[[sqlite3.Connection], T]) -> T:
        """Run ``function`` in one write transaction (on the worker thread)."""
        self._db.execute("BEGIN IMMEDIATE")
        try:
            value = function(self._db)
        except BaseException:
            self._db.execute("ROLLBACK")
            raise
        self._db.execute("COMMIT")
        return value

    # ------------------------------------------------------------------ batches

    async def create_batch(
        self,
        account_id: str,
        model: str,
        bodies: Sequence[bytes],
        webhook_url: str = "",
        file_batch: FileBatchRecord | None = None,
        api_key_id: str = "",
    ) -> str:
        """Store a batch of requests; returns its id. Job ids are ``<batch id>-<position>``.

        A batch with no job (an OpenAI batch whose every line was refused) is finished at once.
        """
        batch_id = f"batch-{uuid.uuid4().hex}"
        now = self._clock_ms()

        def insert(db: sqlite3.Connection) -> None:
            db.execute(
                "INSERT INTO batches (batch_id, account_id, model, webhook_url, jobs, created_at_ms,"
                " finished_at_ms, webhook_state, webhook_due_at_ms) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    batch_id,
                    account_id,
                    model,
                    webhook_url,
                    len(bodies),
                    now,
                    None if bodies else now,
                    "pending" if webhook_url and not bodies else "",
                    now,
                ),
            )
            if file_batch is not None:
                _insert_file_batch(db, batch_id, account_id, file_batch)
            if api_key_id:
                db.execute(
                    "INSERT INTO batch_api_keys (batch_id, key_id) VALUES (?, ?)", (batch_id, api_key_id)
                )
            # seq grows with insertion, as rowid does, so the newest row holds the largest:
            # one index step, where MAX(seq) would read every job.
            last = db.execute("SELECT seq FROM jobs ORDER BY rowid DESC LIMIT 1").fetchone()
            seq = last[0] if last else 0
            db.executemany(
                "INSERT INTO jobs (request_id, batch_id, position, account_id, body, seq)"
                " VALUES (?, ?, ?, ?, ?, ?)",
                [
                    (f"{batch_id}-{i}", batch_id, i, account_id, body, seq + 1 + i)
                    for i, body in enumerate(bodies)
                ],
            )

        await self._run(lambda: self._transaction(insert))
        return batch_id

    async def batch(
        self, batch_id: str, account_id: str, *, results_once_finished: bool = False
    ) -> BatchView | None:
        """The batch if it exists *and* belongs to ``account_id``; else None (callers answer 404).

        ``results_once_finished`` leaves the results out while the batch runs: a poll of a
        running batch of a thousand jobs then reads their states, not every stored answer.
        """
        return await self._run(lambda: self._batch(batch_id, account_id, results_once_finished))

    def _batch(self, batch_id: str, account_id: str, results_once_finished: bool = False) -> BatchView | None:
        row = self._db.execute(
            "SELECT model, webhook_url, webhook_state, created_at_ms, finished_at_ms, cancelled_at_ms,"
            " expired_at_ms FROM batches LEFT JOIN batch_cancellations USING (batch_id)"
            " LEFT JOIN batch_expirations USING (batch_id)"
            " WHERE batch_id = ? AND account_id = ?",
            (batch_id, account_id),
        ).fetchone()
        if row is None:
            return None
        model, webhook_url, webhook_state, created_at_ms, finished_at_ms, cancelled_at_ms, expired_at_ms = row
        result_column = "NULL" if results_once_finished and finished_at_ms is None else "result"
        jobs = self._db.execute(
            f"SELECT state, {result_column} FROM jobs WHERE batch_id = ? ORDER BY position", (batch_id,)
        ).fetchall()
        return BatchView(
            batch_id,
            account_id,
            model,
            batch_state(finished_at_ms, cancelled_at_ms, expired_at_ms, (job_state for job_state, _ in jobs)),
            [] if result_column == "NULL" else [result for _, result in jobs],
            webhook_url,
            webhook_state,
            created_at_ms,
            finished_at_ms,
            cancelled_at_ms,
            [job_state for job_state, _ in jobs],
            expired_at_ms,
        )

    async def cancel_batch(
        self, batch_id: str, account_id: str, cancelled_result: bytes
    ) -> Cancellation | None:
        """End the batch's jobs that have not started, each with ``cancelled_result``; None if no such batch.

        A job counts as started while its lease is live; one whose lease lapsed (its
        router died) would only start again, so it is cancelled too. Cancelling a
        finished or already cancelled batch changes nothing.
        """
        return await self._run(
            lambda: self._transaction(lambda db: self._cancel(db, batch_id, account_id, cancelled_result))
        )

    def _cancel(
        self, db: sqlite3.Connection, batch_id: str, account_id: str, cancelled_result: bytes
    ) -> Cancellation | None:
        now = self._clock_ms()
        row = db.execute(
            "SELECT finished_at_ms FROM batches WHERE batch_id = ? AND account_id = ?", (batch_id, account_id)
        ).fetchone()
        if row is None:
            return None
        if row[0] is not None:
            return Cancellation(cancelled_jobs=0, batch_finished=False)
        db.execute(
            "INSERT OR IGNORE INTO batch_cancellations (batch_id, cancelled_at_ms) VALUES (?, ?)",
            (batch_id, now),
        )
        cancelled = self._end_unstarted_jobs(db, batch_id, cancelled_result, now)
        return Cancellation(cancelled, batch_finished=self._finish_if_ended(db, batch_id, now))

    @staticmethod
    def _end_unstarted_jobs(db: sqlite3.Connection, batch_id: str, result: bytes, now: int) -> int:
        """End (as ``cancelled``, with ``result``) the batch's jobs that are not running; how many."""
        return db.execute(
            f"UPDATE jobs SET state = 'cancelled', result = :result, finished_at_ms = :now, lease_owner = ''"
            f" WHERE batch_id = :batch AND {_RUNNABLE}",
            {"result": result, "now": now, "batch": batch_id},
        ).rowcount

    async def expire_file_batches(self, window_ms: int, expired_result: bytes) -> list[str]:
        """Expire every unfinished OpenAI batch created ``window_ms`` or longer ago.

        As a cancel: its jobs that have not started end with ``expired_result``, started
        ones run to their end. Returns the batches this call finished (their webhooks are
        armed). A batch cancelled first stays cancelled.
        """
        return await self._run(
            lambda: self._transaction(lambda db: self._expire(db, window_ms, expired_result))
        )

    def _expire(self, db: sqlite3.Connection, window_ms: int, expired_result: bytes) -> list[str]:
        now = self._clock_ms()
        overdue = [
            batch_id
            for (batch_id,) in db.execute(
                "SELECT batch_id FROM file_batches JOIN batches USING (batch_id)"
                " WHERE finished_at_ms IS NULL AND created_at_ms <= ?"
                " AND batch_id NOT IN (SELECT batch_id FROM batch_expirations)"
                " AND batch_id NOT IN (SELECT batch_id FROM batch_cancellations)",
                (now - window_ms,),
            ).fetchall()
        ]
        finished = []
        for batch_id in overdue:
            db.execute(
                "INSERT INTO batch_expirations (batch_id, expired_at_ms) VALUES (?, ?)", (batch_id, now)
            )
            self._end_unstarted_jobs(db, batch_id, expired_result, now)
            if self._finish_if_ended(db, batch_id, now):
                finished.append(batch_id)
        return finished

    def _finish_if_ended(self, db: sqlite3.Connection, batch_id: str, now: int) -> bool:
        """Mark the batch finished (and arm its webhook) when no job is left to end; True if this call did."""
        # Two seeks into (batch_id, state), not a count over the batch: at the end of a large
        # batch that count read every row of it for each completion.
        unfinished = db.execute(
            f"SELECT EXISTS (SELECT 1 FROM jobs WHERE batch_id = ? AND state IN {_NOT_ENDED})", (batch_id,)
        ).fetchone()[0]
        if unfinished:
            return False
        return (
            db.execute(
                "UPDATE batches SET finished_at_ms = ?,"
                " webhook_state = CASE WHEN webhook_url = '' THEN '' ELSE 'pending' END, webhook_due_at_ms = ?"
                " WHERE batch_id = ? AND finished_at_ms IS NULL",
                (now, now, batch_id),
            ).rowcount
            == 1
        )

    # --------------------------------------------------------------------- jobs

    async def lease(self, owner: str, lease_seconds: float, after_account: str = "") -> Job | None:
        """Lease the next runnable job, round-robin by account after ``after_account``; None if idle."""
        jobs = await self.lease_many(owner, lease_seconds, after_account, limit=1)
        return jobs[0] if jobs else None

    async def lease_many(
        self, owner: str, lease_seconds: float, after_account: str = "", *, limit: int
    ) -> list[Job]:
        """Up to ``limit`` jobs in one transaction, in the order ``limit`` calls of ``lease`` would
        take them (each after the previous one's account); fewer when the queue runs dry.

        One commit (one fsync) for all: a dispatcher with several free slots at once had waited
        for a commit per slot, on the worker thread its completions and renewals also need.
        """

        def lease_in(db: sqlite3.Connection) -> list[Job]:
            jobs: list[Job] = []
            after = after_account
            while len(jobs) < limit and (job := self._lease(db, owner, lease_seconds, after)) is not None:
                jobs.append(job)
                after = job.account_id
            return jobs

        return await self._run(lambda: self._transaction(lease_in))

    def _lease(self, db: sqlite3.Connection, owner: str, lease_seconds: float, after: str) -> Job | None:
        now = self._clock_ms()
        # The first account after the last one served, wrapping around to the smallest.
        account = db.execute(_NEXT_ACCOUNT, {"now": now, "after": after}).fetchone()[0]
        if account is None:
            account = db.execute(_ANY_ACCOUNT, {"now": now}).fetchone()[0]
        if account is None:
            return None
        arguments = {"now": now, "account": account}
        candidates = [
            row
            for query in (_OLDEST_QUEUED_JOB, _OLDEST_LAPSED_JOB)
            if (row := db.execute(query, arguments).fetchone()) is not None
        ]
        _, request_id, batch_id, position, body, attempts = min(candidates)
        db.execute(
            "UPDATE jobs SET state = 'leased', lease_owner = ?, lease_expires_at_ms = ?, attempts = ?"
            " WHERE request_id = ?",
            (owner, now + int(lease_seconds * 1000), attempts + 1, request_id),
        )
        return Job(request_id, batch_id, position, account, body, owner, attempts + 1)

    async def renew(self, job: Job, lease_seconds: float) -> bool:
        """Extend a lease we still hold; False when it was lost (expired and taken, or finished)."""

        def renew() -> bool:
            cursor = self._db.execute(
                "UPDATE jobs SET lease_expires_at_ms = ?"
                " WHERE request_id = ? AND state = 'leased' AND lease_owner = ? AND attempts = ?",
                (self._clock_ms() + int(lease_seconds * 1000), job.request_id, job.owner, job.attempt),
            )
            return cursor.rowcount == 1

        return await self._run(renew)

    async def release(self, job: Job) -> bool:
        """Give a leased job back to the queue (no capacity now); the attempt does not count."""

        def release() -> bool:
            cursor = self._db.execute(
                "UPDATE jobs SET state = 'queued', lease_owner = '', lease_expires_at_ms = 0,"
                " attempts = attempts - 1"
                " WHERE request_id = ? AND state = 'leased' AND lease_owner = ? AND attempts = ?",
                (job.request_id, job.owner, job.attempt),
            )
            return cursor.rowcount == 1

        return await self._run(release)

    async def complete(self, job: Job, result: bytes) -> Completion:
        """Store ``result`` unless another attempt already did; finish the batch with its last job.

        Any attempt may complete, even one whose lease lapsed: its work is as good as
        the retry's, and the conditional update keeps whichever came first. Completions
        share commits (``CompletionGroups``).
        """
        return await self._completions.complete(job, result)

    async def _write_completions(self, group: Sequence[PendingCompletion]) -> list[Completion | Exception]:
        return await self._run(partial(self._transaction, partial(self._complete_all, group=group)))

    def _complete_all(
        self, db: sqlite3.Connection, group: Sequence[PendingCompletion]
    ) -> list[Completion | Exception]:
        outcomes: list[Completion | Exception] = []
        for pending in group:
            db.execute("SAVEPOINT completion")
            try:
                outcomes.append(self._complete(db, pending.job, pending.result))
            except sqlite3.Error as error:
                db.execute("ROLLBACK TO completion")
                outcomes.append(error)
            db.execute("RELEASE completion")
        return outcomes

    def _complete(self, db: sqlite3.Connection, job: Job, result: bytes) -> Completion:
        now = self._clock_ms()
        stored = db.execute(
            "UPDATE jobs SET state = 'done', result = ?, finished_at_ms = ?, lease_owner = ''"
            " WHERE request_id = ? AND state != 'done'",
            (result, now, job.request_id),
        ).rowcount
        if not stored:
            return Completion(stored=False, batch_finished=False)
        return Completion(stored=True, batch_finished=self._finish_if_ended(db, job.batch_id, now))

    async def counts(self) -> dict[str, int]:
        """Jobs per state (for logs and tests)."""
        return await self._run(self._count_states)

    def counts_off_the_loop(self, timeout: float) -> dict[str, int]:
        """``counts`` for a thread that is not the event loop's (a metrics scrape)."""
        return self._executor.submit(self._count_states).result(timeout)

    def _count_states(self) -> dict[str, int]:
        # Walks the (state, ...) index, not the table: a few ms at 100,000 jobs.
        return dict(self._db.execute("SELECT state, COUNT(*) FROM jobs GROUP BY state").fetchall())

    # ----------------------------------------------------------------- webhooks

    async def claim_webhook(self, hold_seconds: float) -> DueWebhook | None:
        """Take one due delivery, pushing its due time ``hold_seconds`` ahead (a lease on sending it)."""

        def claim(db: sqlite3.Connection) -> DueWebhook | None:
            now = self._clock_ms()
            row = db.execute(
                "SELECT batch_id, account_id, webhook_url, finished_at_ms FROM batches"
                " WHERE webhook_state = 'pending' AND webhook_due_at_ms <= ?"
                " ORDER BY webhook_due_at_ms LIMIT 1",
                (now,),
            ).fetchone()
            if row is None:
                return None
            db.execute(
                "UPDATE batches SET webhook_due_at_ms = ? WHERE batch_id = ?",
                (now + int(hold_seconds * 1000), row[0]),
            )
            attempts = db.execute(
                "SELECT COUNT(*) FROM webhook_attempts WHERE batch_id = ?", (row[0],)
            ).fetchone()[0]
            return DueWebhook(*row, attempts)

        return await self._run(lambda: self._transaction(claim))

    async def record_webhook_attempt(
        self, batch_id: str, http_status: int, error: str, *, delivered: bool, retry_at_ms: int | None
    ) -> None:
        """Append one attempt; then the delivery is done, due again at ``retry_at_ms``, or given up (None)."""

        def record(db: sqlite3.Connection) -> None:
            now = self._clock_ms()
            attempt = db.execute(
                "SELECT COALESCE(MAX(attempt), 0) + 1 FROM webhook_attempts WHERE batch_id = ?", (batch_id,)
            ).fetchone()[0]
            db.execute(
                "INSERT INTO webhook_attempts (batch_id, attempt, at_ms, http_status, error) VALUES (?, ?, ?, ?, ?)",
                (batch_id, attempt, now, http_status, error),
            )
            if delivered:
                db.execute("UPDATE batches SET webhook_state = 'delivered' WHERE batch_id = ?", (batch_id,))
            elif retry_at_ms is None:
                db.execute("UPDATE batches SET webhook_state = 'failed' WHERE batch_id = ?", (batch_id,))
            else:
                db.execute(
                    "UPDATE batches SET webhook_due_at_ms = ? WHERE batch_id = ?", (retry_at_ms, batch_id)
                )

        await self._run(lambda: self._transaction(record))

    async def webhook_attempts(self, batch_id: str) -> list[WebhookAttempt]:
        rows = await self._run(
            lambda: self._db.execute(
                "SELECT attempt, at_ms, http_status, error FROM webhook_attempts WHERE batch_id = ? ORDER BY attempt",
                (batch_id,),
            ).fetchall()
        )
        return [WebhookAttempt(*row) for row in rows]

    # -------------------------------------------------------- OpenAI files and batches

    async def put_file(self, account_id: str, filename: str, purpose: str, content: bytes) -> StoredFile:
        """Store an uploaded file; durable once this returns."""
        file_id = f"file-{uuid.uuid4().hex}"
        now = self._clock_ms()

        def insert() -> None:
            self._db.execute(
                "INSERT INTO files (file_id, account_id, filename, purpose, created_at_ms, content)"
                " VALUES (?, ?, ?, ?, ?, ?)",
                (file_id, account_id, filename, purpose, now, content),
            )

        await self._run(insert)
        return StoredFile(file_id, account_id, filename, purpose, now, len(content))

    async def file(self, file_id: str, account_id: str) -> StoredFile | None:
        """The file if it exists *and* belongs to ``account_id``."""
        row = await self._run(
            lambda: self._db.execute(
                "SELECT file_id, account_id, filename, purpose, created_at_ms, LENGTH(content) FROM files"
                " WHERE file_id = ? AND account_id = ?",
                (file_id, account_id),
            ).fetchone()
        )
        return None if row is None else StoredFile(*row)

    async def file_content(self, file_id: str, account_id: str) -> bytes | None:
        row = await self._run(
            lambda: self._db.execute(
                "SELECT content FROM files WHERE file_id = ? AND account_id = ?", (file_id, account_id)
            ).fetchone()
        )
        return None if row is None else row[0]

    async def file_batch(self, batch_id: str, account_id: str) -> FileBatchRecord | None:
        """The OpenAI part of a batch of ``account_id``; None for another's or a plain queued batch."""
        row = await self._run(
            lambda: self._db.execute(
                "SELECT input_file_id, endpoint, completion_window, metadata, custom_ids, rejected"
                " FROM file_batches WHERE batch_id = ? AND account_id = ?",
                (batch_id, account_id),
            ).fetchone()
        )
        if row is None:
            return None
        return FileBatchRecord.from_stored(*row)

    async def file_batch_ids(self, account_id: str, after: str, limit: int) -> tuple[list[str], bool]:
        """Up to ``limit`` OpenAI batch ids of the account, newest first, older than ``after``; and whether more follow."""

        def page() -> tuple[list[str], bool]:
            rows = self._db.execute(
                "SELECT batch_id FROM file_batches WHERE account_id = :account"
                " AND (:after = '' OR rowid < (SELECT rowid FROM file_batches WHERE batch_id = :after))"
                " ORDER BY rowid DESC LIMIT :limit",
                {"account": account_id, "after": after, "limit": limit + 1},
            ).fetchall()
            return [row[0] for row in rows[:limit]], len(rows) > limit

        return await self._run(page)

    # ------------------------------------------------------------------ managed API keys

    async def create_api_key(self, key: ApiKey) -> None:
        await self._run(
            lambda: self._db.execute(
                f"INSERT INTO api_keys ({API_KEY_COLUMNS}) VALUES ({', '.join('?' * 11)})", api_key_row(key)
            )
        )

    async def api_key(self, key_id: str) -> ApiKey | None:
        row = await self._run(
            lambda: self._db.execute(
                f"SELECT {API_KEY_COLUMNS} FROM api_keys WHERE key_id = ?", (key_id,)
            ).fetchone()
        )
        return None if row is None else api_key_from_row(row)

    async def api_keys(self, account_id: str = "") -> list[ApiKey]:
        """The account's keys (every key for ""), oldest first, revoked and expired ones included."""
        rows = await self._run(
            lambda: self._db.execute(
                f"SELECT {API_KEY_COLUMNS} FROM api_keys WHERE ? = '' OR account_id = ?"
                " ORDER BY created_at_ms, key_id",
                (account_id, account_id),
            ).fetchall()
        )
        return [api_key_from_row(row) for row in rows]

    async def revoke_api_key(self, key_id: str) -> ApiKey | None:
        """Revoke the key (a second revoke keeps the first time); None if there is no such key."""
        now = self._clock_ms()
        await self._run(
            lambda: self._db.execute(
                "UPDATE api_keys SET revoked_at_ms = ? WHERE key_id = ? AND revoked_at_ms = 0", (now, key_id)
            )
        )
        return await self.api_key(key_id)

    async def touch_api_key(self, key_id: str, at_ms: int) -> None:
        await self._run(
            lambda: self._db.execute(
                "UPDATE api_keys SET last_used_at_ms = ? WHERE key_id = ? AND last_used_at_ms < ?",
                (at_ms, key_id, at_ms),
            )
        )

    async def batch_api_key(self, batch_id: str) -> str:
        """The managed key a batch was queued with; "" for another key."""
        row = await self._run(
            lambda: self._db.execute(
                "SELECT key_id FROM batch_api_keys WHERE batch_id = ?", (batch_id,)
            ).fetchone()
        )
        return "" if row is None else row[0]

    # ------------------------------------------------------------------ stored responses

    async def put_response(self, account_id: str, response: StoredResponse) -> None:
        """Store ``response`` with its input items, replacing one of the same id; durable once this returns."""

        def put(db: sqlite3.Connection) -> None:
            key = (account_id, response.response_id)
            db.execute("DELETE FROM stored_response_items WHERE account_id = ? AND response_id = ?", key)
            db.execute(
                "INSERT OR REPLACE INTO stored_responses"
                " (account_id, response_id, created_at, session_id, response) VALUES (?, ?, ?, ?, ?)",
                (*key, response.created_at, response.session_id, response.body),
            )
            db.executemany(
                "INSERT INTO stored_response_items (account_id, response_id, position, item_id, item)"
                " VALUES (?, ?, ?, ?, ?)",
                [(*key, n, item.item_id, item.body) for n, item in enumerate(response.input_items)],
            )

        await self._run(partial(self._transaction, put))

    async def response(
        self, account_id: str, response_id: str, *, with_items: bool = False
    ) -> StoredResponse | None:
        """The account's stored response of that id (None for another account's)."""

        def read() -> StoredResponse | None:
            key = (account_id, response_id)
            row = self._db.execute(
                "SELECT created_at, session_id, response FROM stored_responses"
                " WHERE account_id = ? AND response_id = ?",
                key,
            ).fetchone()
            if row is None:
                return None
            items = ()
            if with_items:
                items = self._db.execute(
                    "SELECT item_id, item FROM stored_response_items"
                    " WHERE account_id = ? AND response_id = ? ORDER BY position",
                    key,
                ).fetchall()
            return StoredResponse(response_id, *row, tuple(ResponseItem(*item) for item in items))

        # One read transaction: a put committing between the two selects is not half seen.
        return await self._run(partial(self._read, read))

    async def delete_response(self, account_id: str, response_id: str) -> bool:
        """Forget the account's stored response and its items; False if it had none of that id."""

        def delete(db: sqlite3.Connection) -> bool:
            key = (account_id, response_id)
            db.execute("DELETE FROM stored_response_items WHERE account_id = ? AND response_id = ?", key)
            return (
                db.execute(
                    "DELETE FROM stored_responses WHERE account_id = ? AND response_id = ?", key
                ).rowcount
                > 0
            )

        return await self._run(partial(self._transaction, delete))

    async def response_items(
        self, account_id: str, response_id: str, *, newest_first: bool, after: str, limit: int
    ) -> tuple[list[ResponseItem], bool] | None:
        """Up to ``limit`` input items in the order asked, past the item ``after`` (none: from the
        first), and whether more follow; None when ``after`` names no item of that response."""
        direction, compare, pick = ("DESC", "<", "MAX") if newest_first else ("ASC", ">", "MIN")

        def page() -> tuple[list[ResponseItem], bool] | None:
            key = {"account": account_id, "response": response_id, "after": after, "limit": limit + 1}
            where = "account_id = :account AND response_id = :response"
            bound = ""
            if after:
                start = self._db.execute(
                    f"SELECT {pick}(position) FROM stored_response_items WHERE {where} AND item_id = :after",
                    key,
                ).fetchone()[0]
                if start is None:
                    return None
                key["start"] = start
                bound = f" AND position {compare} :start"
            rows = self._db.execute(
                f"SELECT item_id, item FROM stored_response_items WHERE {where}{bound}"
                f" ORDER BY position {direction} LIMIT :limit",
                key,
            ).fetchall()
            return [ResponseItem(*row) for row in rows[:limit]], len(rows) > limit

        return await self._run(page)

    def _read(self, function: Callable[[], T]) -> T:
        """Run ``function`` in one read transaction (on the worker thread): one snapshot for every select."""
        self._db.execute("BEGIN")
        try:
            return function()
        finally:
            self._db.execute("COMMIT")


def _insert_file_batch(
    db: sqlite3.Connection, batch_id: str, account_id: str, record: FileBatchRecord
) -> None:
    db.execute(
        "INSERT INTO file_batches (batch_id, account_id, input_file_id, endpoint, completion_window, metadata,"
        " custom_ids, rejected) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
        (
            batch_id,
            account_id,
            record.input_file_id,
            record.endpoint,
            record.completion_window,
            json.dumps(record.metadata),
            json.dumps(record.custom_ids),
            json.dumps([list(line) for line in record.rejected]),
        ),
    )
