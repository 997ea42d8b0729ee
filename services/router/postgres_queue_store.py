"""The durable async queue on PostgreSQL, for routers that share one database.

The contract is ``cachet.router.queue_store``'s and the tables are the SQLite
store's. What SQLite gets from its single writer, this store gets from row locks:

- A lease takes the oldest runnable job of the next account with
  ``FOR UPDATE SKIP LOCKED``: a job another router is leasing right now is skipped,
  never waited for and never handed out twice.
- A completion, cancel or expiry locks its batch's row before it touches the
  batch's jobs, so the call that ends a batch's last job always sees the others'
  ends and finishes the batch exactly once. Groups of completions lock their
  batches in id order, and leases wait on no lock at all, so no two transactions
  can wait on each other.
- ``complete``'s ``UPDATE ... WHERE state != 'done'`` waits for a concurrent update
  of the same job to commit and then re-reads it (read committed), so of two
  routers that ran one job, only the first stores its result.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence

import asyncpg

from cachet.durable_postgres import connection_lost, describe, open_pool, pooled_connection
from cachet.logs import get_logger
from cachet.router.api_keys import API_KEY_COLUMNS, ApiKey, api_key_from_row, api_key_row
from cachet.router.completion_groups import CompletionGroups, PendingCompletion
from cachet.router.queue_records import (
    BatchView,
    Cancellation,
    Completion,
    DueWebhook,
    FileBatchRecord,
    Job,
    ResponseItem,
    StoredFile,
    StoredResponse,
    WebhookAttempt,
    batch_state,
)

log = get_logger(__name__)

STORE = "queue"

# Ids compare byte by byte (COLLATE "C"), as SQLite compares them: round-robin by account
# visits accounts in the same order on either store, and the index needs no locale.
MIGRATIONS = [
    (
        1,
        """
CREATE TABLE batches (
    batch_id TEXT PRIMARY KEY,
    account_id TEXT NOT NULL,
    model TEXT NOT NULL,
    webhook_url TEXT NOT NULL,
    jobs INTEGER NOT NULL,
    created_at_ms BIGINT NOT NULL,
    -- Set once, by the complete() that finished the last job.
    finished_at_ms BIGINT,
    -- '' (no webhook), 'pending', 'delivered' or 'failed'.
    webhook_state TEXT NOT NULL DEFAULT '',
    -- When the next delivery attempt is due; doubles as the sender's lease.
    webhook_due_at_ms BIGINT NOT NULL DEFAULT 0
);
CREATE INDEX batches_webhook_due ON batches (webhook_due_at_ms) WHERE webhook_state = 'pending';
CREATE TABLE jobs (
    request_id TEXT PRIMARY KEY,
    batch_id TEXT NOT NULL REFERENCES batches (batch_id),
    position INTEGER NOT NULL,
    account_id TEXT COLLATE "C" NOT NULL,
    -- Serialized cachet.router.v1.QueuedRequest.
    body BYTEA NOT NULL,
    state TEXT NOT NULL DEFAULT 'queued',
    -- Global arrival order; the jobs of one batch take theirs in position order.
    seq BIGINT GENERATED ALWAYS AS IDENTITY,
    lease_owner TEXT NOT NULL DEFAULT '',
    lease_expires_at_ms BIGINT NOT NULL DEFAULT 0,
    attempts INTEGER NOT NULL DEFAULT 0,
    -- Serialized cachet.router.v1.QueuedResult, written once.
    result BYTEA,
    finished_at_ms BIGINT,
    UNIQUE (batch_id, position)
);
-- The dispatcher's question, "what is runnable, per account, oldest first?".
CREATE INDEX jobs_runnable ON jobs (state, account_id, seq);
-- Each completion's question, "is any job of this batch left to end?".
CREATE INDEX jobs_by_batch_state ON jobs (batch_id, state);
CREATE TABLE webhook_attempts (
    batch_id TEXT NOT NULL REFERENCES batches (batch_id),
    attempt INTEGER NOT NULL,
    at_ms BIGINT NOT NULL,
    -- HTTP status of the answer; 0 when there was none (connection failed, timed out).
    http_status INTEGER NOT NULL,
    error TEXT NOT NULL,
    PRIMARY KEY (batch_id, attempt)
);
CREATE TABLE batch_cancellations (
    batch_id TEXT PRIMARY KEY REFERENCES batches (batch_id),
    cancelled_at_ms BIGINT NOT NULL
);
-- OpenAI batches whose completion window ended before they did.
CREATE TABLE batch_expirations (
    batch_id TEXT PRIMARY KEY REFERENCES batches (batch_id),
    expired_at_ms BIGINT NOT NULL
);
CREATE TABLE files (
    file_id TEXT PRIMARY KEY,
    account_id TEXT NOT NULL,
    filename TEXT NOT NULL,
    purpose TEXT NOT NULL,
    created_at_ms BIGINT NOT NULL,
    content BYTEA NOT NULL
);
CREATE TABLE file_batches (
    batch_id TEXT PRIMARY KEY REFERENCES batches (batch_id),
    -- Listing order (newest first), as SQLite's rowid.
    seq BIGINT GENERATED ALWAYS AS IDENTITY,
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
CREATE INDEX file_batches_by_account ON file_batches (account_id, seq);
""",
    ),
    (
        2,
        """
-- Managed API keys (api_keys.py): the key's SHA-256, never the key. Times in Unix ms, 0: never.
CREATE TABLE api_keys (
    key_id TEXT PRIMARY KEY,
    key_hash TEXT NOT NULL,
    account_id TEXT NOT NULL,
    name TEXT NOT NULL,
    created_at_ms BIGINT NOT NULL,
    expires_at_ms BIGINT NOT NULL DEFAULT 0,
    revoked_at_ms BIGINT NOT NULL DEFAULT 0,
    last_used_at_ms BIGINT NOT NULL DEFAULT 0,
    -- Limits; 0: none.
    requests_per_minute BIGINT NOT NULL DEFAULT 0,
    tokens_per_minute BIGINT NOT NULL DEFAULT 0,
    monthly_budget_picousd BIGINT NOT NULL DEFAULT 0
);
CREATE INDEX api_keys_by_account ON api_keys (account_id, created_at_ms);
-- The managed key a batch was queued with: its jobs count against that key's limits when they run.
CREATE TABLE batch_api_keys (
    batch_id TEXT PRIMARY KEY REFERENCES batches (batch_id),
    key_id TEXT NOT NULL
);
""",
    ),
    (
        3,
        """
-- OpenAI Responses' stored responses: the JSON as answered (the bridge's; kept unread) and
-- the session a follow-up runs under. Times in Unix seconds, as OpenAI's created_at.
CREATE TABLE stored_responses (
    account_id TEXT NOT NULL,
    response_id TEXT NOT NULL,
    created_at BIGINT NOT NULL,
    session_id TEXT NOT NULL,
    response BYTEA NOT NULL,
    PRIMARY KEY (account_id, response_id)
);
-- A stored response's input items, one row each in conversation order, so a page of
-- input_items reads only its rows.
CREATE TABLE stored_response_items (
    account_id TEXT NOT NULL,
    response_id TEXT NOT NULL,
    position INTEGER NOT NULL,
    item_id TEXT NOT NULL,
    item BYTEA NOT NULL,
    PRIMARY KEY (account_id, response_id, position)
);
""",
    ),
]

# Jobs that may run: queued, or leased by an owner whose lease has lapsed ($2: now).
_RUNNABLE = "(state = 'queued' OR (state = 'leased' AND lease_expires_at_ms <= $2))"

# Lease the oldest runnable job of the first account past $1, in one statement. Each kind
# of runnable job is asked once so each scan starts at its first entry of (state,
# account_id, seq) rather than sorting every runnable row; SKIP LOCKED passes over a job
# another transaction is leasing. Of the two rows found (both locked until commit), the
# older account's, then the older job, is leased.
_LEASE = """
WITH queued AS (
    SELECT request_id, account_id, seq FROM jobs
    WHERE state = 'queued' AND account_id {bound} $1
    ORDER BY account_id, seq LIMIT 1 FOR UPDATE SKIP LOCKED
), lapsed AS (
    SELECT request_id, account_id, seq FROM jobs
    WHERE state = 'leased' AND lease_expires_at_ms <= $2 AND account_id {bound} $1
    ORDER BY account_id, seq LIMIT 1 FOR UPDATE SKIP LOCKED
), chosen AS (
    SELECT request_id FROM (SELECT * FROM queued UNION ALL SELECT * FROM lapsed) AS candidates
    ORDER BY account_id, seq LIMIT 1
)
UPDATE jobs SET state = 'leased', lease_owner = $3, lease_expires_at_ms = $4, attempts = jobs.attempts + 1
FROM chosen WHERE jobs.request_id = chosen.request_id
RETURNING jobs.request_id, jobs.batch_id, jobs.position, jobs.account_id, jobs.body, jobs.attempts"""
_LEASE_NEXT = _LEASE.format(bound=">")
_LEASE_ANY = _LEASE.format(bound=">=")  # with $1 = '': every text sorts at or after ''

# A group's results in one statement; a job named twice is updated once.
_COMPLETE_ALL = """
UPDATE jobs SET state = 'done', result = completions.result, finished_at_ms = $3, lease_owner = ''
FROM unnest($1::text[], $2::bytea[]) AS completions (request_id, result)
WHERE jobs.request_id = completions.request_id AND jobs.state != 'done'
RETURNING jobs.request_id, jobs.batch_id"""
# The group's batches with no job left to end, finished (webhook armed) by this statement.
_FINISH_ENDED = """
UPDATE batches SET finished_at_ms = $2,
    webhook_state = CASE WHEN webhook_url = '' THEN '' ELSE 'pending' END, webhook_due_at_ms = $2
WHERE batch_id = ANY($1::text[]) AND finished_at_ms IS NULL
AND NOT EXISTS (SELECT 1 FROM jobs WHERE jobs.batch_id = batches.batch_id AND state IN ('queued', 'leased'))
RETURNING batch_id"""


def _now_ms() -> int:
    return int(time.time() * 1000)


def _affected(status: str) -> int:
    """Rows a statement changed, from its command tag ("UPDATE 3")."""
    return int(status.rsplit(" ", 1)[1])


class PostgresQueueStore:
    """The queue's durable state in a PostgreSQL database; every method is safe to call concurrently,
    from this process or any other sharing the database."""

    def __init__(self, pool: asyncpg.Pool, location: str, clock_ms: Callable[[], int] = _now_ms) -> None:
        # Use ``open``: it applies the migrations first.
        self._pool = pool
        self.location = location
        self._clock_ms = clock_ms
        self._loop = asyncio.get_running_loop()
        self._completions = CompletionGroups(self._write_completions)

    @classmethod
    async def open(cls, url: str, clock_ms: Callable[[], int] = _now_ms) -> PostgresQueueStore:
        pool = await open_pool(url, MIGRATIONS, store=STORE)
        log.info("queue store opened", store="postgresql", database=describe(url))
        return cls(pool, describe(url), clock_ms)

    async def close(self) -> None:
        await self._completions.drain()
        await self._pool.close()

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
        """Store a batch of requests; returns its id. Job ids are ``<batch id>-<position>``."""
        batch_id = f"batch-{uuid.uuid4().hex}"
        now = self._clock_ms()
        async with self._transaction() as db:
            await db.execute(
                "INSERT INTO batches (batch_id, account_id, model, webhook_url, jobs, created_at_ms,"
                " finished_at_ms, webhook_state, webhook_due_at_ms) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9)",
                batch_id,
                account_id,
                model,
                webhook_url,
                len(bodies),
                now,
                None if bodies else now,
                "pending" if webhook_url and not bodies else "",
                now,
            )
            if file_batch is not None:
                await _insert_file_batch(db, batch_id, account_id, file_batch)
            if api_key_id:
                await db.execute(
                    "INSERT INTO batch_api_keys (batch_id, key_id) VALUES ($1, $2)", batch_id, api_key_id
                )
            # One statement for the lot; ORDER BY hands out seq in position order.
            await db.execute(
                "INSERT INTO jobs (request_id, batch_id, position, account_id, body)"
                " SELECT $1 || '-' || (n - 1), $1, n - 1, $2, body"
                " FROM unnest($3::bytea[]) WITH ORDINALITY AS lines (body, n) ORDER BY n",
                batch_id,
                account_id,
                list(bodies),
            )
        return batch_id

    async def batch(
        self, batch_id: str, account_id: str, *, results_once_finished: bool = False
    ) -> BatchView | None:
        """The batch if it exists *and* belongs to ``account_id``; else None (callers answer 404)."""
        async with self._connection() as db:
            row = await db.fetchrow(
                "SELECT model, webhook_url, webhook_state, created_at_ms, finished_at_ms, cancelled_at_ms,"
                " expired_at_ms FROM batches LEFT JOIN batch_cancellations USING (batch_id)"
                " LEFT JOIN batch_expirations USING (batch_id)"
                " WHERE batch_id = $1 AND account_id = $2",
                batch_id,
                account_id,
            )
            if row is None:
                return None
            with_results = not (results_once_finished and row["finished_at_ms"] is None)
            result_column = "result" if with_results else "NULL::bytea"
            jobs = await db.fetch(
                f"SELECT state, {result_column} FROM jobs WHERE batch_id = $1 ORDER BY position", batch_id
            )
        states = [job[0] for job in jobs]
        return BatchView(
            batch_id,
            account_id,
            row["model"],
            batch_state(row["finished_at_ms"], row["cancelled_at_ms"], row["expired_at_ms"], states),
            [job[1] for job in jobs] if with_results else [],
            row["webhook_url"],
            row["webhook_state"],
            row["created_at_ms"],
            row["finished_at_ms"],
            row["cancelled_at_ms"],
            states,
            row["expired_at_ms"],
        )

    async def cancel_batch(
        self, batch_id: str, account_id: str, cancelled_result: bytes
    ) -> Cancellation | None:
        """End the batch's jobs that have not started, each with ``cancelled_result``; None if no such batch."""
        now = self._clock_ms()
        async with self._transaction() as db:
            row = await db.fetchrow(
                "SELECT finished_at_ms FROM batches WHERE batch_id = $1 AND account_id = $2 FOR UPDATE",
                batch_id,
                account_id,
            )
            if row is None:
                return None
            if row["finished_at_ms"] is not None:
                return Cancellation(cancelled_jobs=0, batch_finished=False)
            await db.execute(
                "INSERT INTO batch_cancellations (batch_id, cancelled_at_ms) VALUES ($1, $2)"
                " ON CONFLICT (batch_id) DO NOTHING",
                batch_id,
                now,
            )
            cancelled = await _end_unstarted_jobs(db, batch_id, cancelled_result, now)
            return Cancellation(cancelled, batch_finished=await _finish_if_ended(db, batch_id, now))

    async def expire_file_batches(self, window_ms: int, expired_result: bytes) -> list[str]:
        """Expire every unfinished OpenAI batch created ``window_ms`` or longer ago; the ones this call finished."""
        now = self._clock_ms()
        finished = []
        async with self._transaction() as db:
            overdue = await db.fetch(
                "SELECT batch_id FROM file_batches JOIN batches USING (batch_id)"
                " WHERE finished_at_ms IS NULL AND created_at_ms <= $1"
                " AND batch_id NOT IN (SELECT batch_id FROM batch_expirations)"
                " AND batch_id NOT IN (SELECT batch_id FROM batch_cancellations)"
                " ORDER BY batch_id",
                now - window_ms,
            )
            for (batch_id,) in overdue:
                # Another router's sweep, or a cancel, may have got there between the
                # listing and this lock: only the batch's first end counts.
                await db.execute("SELECT 1 FROM batches WHERE batch_id = $1 FOR UPDATE", batch_id)
                expired = await db.fetchval(
                    "INSERT INTO batch_expirations (batch_id, expired_at_ms)"
                    " SELECT $1, $2 WHERE NOT EXISTS (SELECT 1 FROM batch_cancellations WHERE batch_id = $1)"
                    " ON CONFLICT (batch_id) DO NOTHING RETURNING 1",
                    batch_id,
                    now,
                )
                if expired is None:
                    continue
                await _end_unstarted_jobs(db, batch_id, expired_result, now)
                if await _finish_if_ended(db, batch_id, now):
                    finished.append(batch_id)
        return finished

    # --------------------------------------------------------------------- jobs

    async def lease(self, owner: str, lease_seconds: float, after_account: str = "") -> Job | None:
        """Lease the next runnable job, round-robin by account after ``after_account``; None if idle."""
        jobs = await self.lease_many(owner, lease_seconds, after_account, limit=1)
        return jobs[0] if jobs else None

    async def lease_many(
        self, owner: str, lease_seconds: float, after_account: str = "", *, limit: int
    ) -> list[Job]:
        """Up to ``limit`` jobs in one transaction, in the order ``limit`` calls of ``lease`` would take them."""
        jobs: list[Job] = []
        async with self._transaction() as db:
            after = after_account
            while (
                len(jobs) < limit and (job := await self._lease(db, owner, lease_seconds, after)) is not None
            ):
                jobs.append(job)
                after = job.account_id
        return jobs

    async def _lease(
        self, db: asyncpg.Connection, owner: str, lease_seconds: float, after: str
    ) -> Job | None:
        now = self._clock_ms()
        expires = now + int(lease_seconds * 1000)
        # The first account after the last one served, wrapping around to the smallest.
        row = await db.fetchrow(_LEASE_NEXT, after, now, owner, expires) or await db.fetchrow(
            _LEASE_ANY, "", now, owner, expires
        )
        if row is None:
            return None
        return Job(
            row["request_id"],
            row["batch_id"],
            row["position"],
            row["account_id"],
            row["body"],
            owner,
            row["attempts"],
        )

    async def renew(self, job: Job, lease_seconds: float) -> bool:
        """Extend a lease we still hold; False when it was lost (expired and taken, or finished)."""
        async with self._connection() as db:
            status = await db.execute(
                "UPDATE jobs SET lease_expires_at_ms = $1"
                " WHERE request_id = $2 AND state = 'leased' AND lease_owner = $3 AND attempts = $4",
                self._clock_ms() + int(lease_seconds * 1000),
                job.request_id,
                job.owner,
                job.attempt,
            )
        return _affected(status) == 1

    async def release(self, job: Job) -> bool:
        """Give a leased job back to the queue (no capacity now); the attempt does not count."""
        async with self._connection() as db:
            status = await db.execute(
                "UPDATE jobs SET state = 'queued', lease_owner = '', lease_expires_at_ms = 0,"
                " attempts = attempts - 1"
                " WHERE request_id = $1 AND state = 'leased' AND lease_owner = $2 AND attempts = $3",
                job.request_id,
                job.owner,
                job.attempt,
            )
        return _affected(status) == 1

    async def complete(self, job: Job, result: bytes) -> Completion:
        """Store ``result`` unless another attempt already did; finish the batch with its last job.

        Completions share commits (``CompletionGroups``), each in a savepoint of its own.
        """
        return await self._completions.complete(job, result)

    async def _write_completions(self, group: Sequence[PendingCompletion]) -> list[Completion | Exception]:
        async with self._transaction() as db:
            # Every batch of the group locked up front, in id order: two routers' groups that
            # share batches then queue behind each other instead of deadlocking.
            await db.execute(
                "SELECT 1 FROM batches WHERE batch_id = ANY($1::text[]) ORDER BY batch_id FOR UPDATE",
                sorted({pending.job.batch_id for pending in group}),
            )
            try:
                async with db.transaction():
                    return await self._complete_together(db, group)
            except asyncpg.PostgresError as error:
                if connection_lost(error):
                    raise
                # One of them cannot be written: each in a savepoint of its own, so it fails alone.
            outcomes: list[Completion | Exception] = []
            for pending in group:
                try:
                    async with db.transaction():
                        outcomes.append(await self._complete(db, pending.job, pending.result))
                except asyncpg.PostgresError as error:
                    if connection_lost(error):
                        raise
                    outcomes.append(error)
            return outcomes

    async def _complete_together(
        self, db: asyncpg.Connection, group: Sequence[PendingCompletion]
    ) -> list[Completion | Exception]:
        """The group in two statements (results, then the batches they ended); one completion
        after another took five round trips each, and held a router's drain below its leases."""
        now = self._clock_ms()
        first: dict[str, int] = {}
        for index, pending in enumerate(group):
            first.setdefault(pending.job.request_id, index)
        rows = await db.fetch(_COMPLETE_ALL, list(first), [group[i].result for i in first.values()], now)
        stored = {first[row["request_id"]] for row in rows}
        ended = {
            row["batch_id"]
            for row in await db.fetch(_FINISH_ENDED, sorted({r["batch_id"] for r in rows}), now)
        }
        # One completion reports its batch's end: the last one of the group stored for it.
        reporter = {group[index].job.batch_id: index for index in sorted(stored)}
        return [
            Completion(
                stored=index in stored,
                batch_finished=index in stored
                and pending.job.batch_id in ended
                and reporter[pending.job.batch_id] == index,
            )
            for index, pending in enumerate(group)
        ]

    async def _complete(self, db: asyncpg.Connection, job: Job, result: bytes) -> Completion:
        now = self._clock_ms()
        status = await db.execute(
            "UPDATE jobs SET state = 'done', result = $1, finished_at_ms = $2, lease_owner = ''"
            " WHERE request_id = $3 AND state != 'done'",
            result,
            now,
            job.request_id,
        )
        if not _affected(status):
            return Completion(stored=False, batch_finished=False)
        return Completion(stored=True, batch_finished=await _finish_if_ended(db, job.batch_id, now))

    async def counts(self) -> dict[str, int]:
        """Jobs per state (for logs and tests)."""
        async with self._connection() as db:
            rows = await db.fetch("SELECT state, COUNT(*) FROM jobs GROUP BY state")
        return {state: count for state, count in rows}

    def counts_off_the_loop(self, timeout: float) -> dict[str, int]:
        """``counts`` for a thread that is not the event loop's (a metrics scrape)."""
        return asyncio.run_coroutine_threadsafe(self.counts(), self._loop).result(timeout)

    # ----------------------------------------------------------------- webhooks

    async def claim_webhook(self, hold_seconds: float) -> DueWebhook | None:
        """Take one due delivery, pushing its due time ``hold_seconds`` ahead (a lease on sending it)."""
        now = self._clock_ms()
        async with self._transaction() as db:
            row = await db.fetchrow(
                "SELECT batch_id, account_id, webhook_url, finished_at_ms FROM batches"
                " WHERE webhook_state = 'pending' AND webhook_due_at_ms <= $1"
                " ORDER BY webhook_due_at_ms LIMIT 1 FOR UPDATE SKIP LOCKED",
                now,
            )
            if row is None:
                return None
            await db.execute(
                "UPDATE batches SET webhook_due_at_ms = $1 WHERE batch_id = $2",
                now + int(hold_seconds * 1000),
                row["batch_id"],
            )
            attempts = await db.fetchval(
                "SELECT COUNT(*) FROM webhook_attempts WHERE batch_id = $1", row["batch_id"]
            )
        return DueWebhook(*row, attempts)

    async def record_webhook_attempt(
        self, batch_id: str, http_status: int, error: str, *, delivered: bool, retry_at_ms: int | None
    ) -> None:
        """Append one attempt; then the delivery is done, due again at ``retry_at_ms``, or given up (None)."""
        now = self._clock_ms()
        async with self._transaction() as db:
            await db.execute(
                "INSERT INTO webhook_attempts (batch_id, attempt, at_ms, http_status, error)"
                " SELECT $1, COALESCE(MAX(attempt), 0) + 1, $2, $3, $4 FROM webhook_attempts WHERE batch_id = $1",
                batch_id,
                now,
                http_status,
                error,
            )
            if delivered:
                await db.execute(
                    "UPDATE batches SET webhook_state = 'delivered' WHERE batch_id = $1", batch_id
                )
            elif retry_at_ms is None:
                await db.execute("UPDATE batches SET webhook_state = 'failed' WHERE batch_id = $1", batch_id)
            else:
                await db.execute(
                    "UPDATE batches SET webhook_due_at_ms = $1 WHERE batch_id = $2", retry_at_ms, batch_id
                )

    async def webhook_attempts(self, batch_id: str) -> list[WebhookAttempt]:
        async with self._connection() as db:
            rows = await db.fetch(
                "SELECT attempt, at_ms, http_status, error FROM webhook_attempts"
                " WHERE batch_id = $1 ORDER BY attempt",
                batch_id,
            )
        return [WebhookAttempt(*row) for row in rows]

    # -------------------------------------------------------- OpenAI files and batches

    async def put_file(self, account_id: str, filename: str, purpose: str, content: bytes) -> StoredFile:
        """Store an uploaded file; durable once this returns."""
        file_id = f"file-{uuid.uuid4().hex}"
        now = self._clock_ms()
        async with self._connection() as db:
            await db.execute(
                "INSERT INTO files (file_id, account_id, filename, purpose, created_at_ms, content)"
                " VALUES ($1, $2, $3, $4, $5, $6)",
                file_id,
                account_id,
                filename,
                purpose,
                now,
                content,
            )
        return StoredFile(file_id, account_id, filename, purpose, now, len(content))

    async def file(self, file_id: str, account_id: str) -> StoredFile | None:
        """The file if it exists *and* belongs to ``account_id``."""
        async with self._connection() as db:
            row = await db.fetchrow(
                "SELECT file_id, account_id, filename, purpose, created_at_ms, octet_length(content) FROM files"
                " WHERE file_id = $1 AND account_id = $2",
                file_id,
                account_id,
            )
        return None if row is None else StoredFile(*row)

    async def file_content(self, file_id: str, account_id: str) -> bytes | None:
        async with self._connection() as db:
            return await db.fetchval(
                "SELECT content FROM files WHERE file_id = $1 AND account_id = $2", file_id, account_id
            )

    async def file_batch(self, batch_id: str, account_id: str) -> FileBatchRecord | None:
        """The OpenAI part of a batch of ``account_id``; None for another's or a plain queued batch."""
        async with self._connection() as db:
            row = await db.fetchrow(
                "SELECT input_file_id, endpoint, completion_window, metadata, custom_ids, rejected"
                " FROM file_batches WHERE batch_id = $1 AND account_id = $2",
                batch_id,
                account_id,
            )
        if row is None:
            return None
        return FileBatchRecord.from_stored(*row)

    async def file_batch_ids(self, account_id: str, after: str, limit: int) -> tuple[list[str], bool]:
        """Up to ``limit`` OpenAI batch ids of the account, newest first, older than ``after``; and whether more follow."""
        async with self._connection() as db:
            rows = await db.fetch(
                "SELECT batch_id FROM file_batches WHERE account_id = $1"
                " AND ($2 = '' OR seq < (SELECT seq FROM file_batches WHERE batch_id = $2))"
                " ORDER BY seq DESC LIMIT $3",
                account_id,
                after,
                limit + 1,
            )
        return [row[0] for row in rows[:limit]], len(rows) > limit

    # ------------------------------------------------------------------ managed API keys

    async def create_api_key(self, key: ApiKey) -> None:
        placeholders = ", ".join(f"${n}" for n in range(1, 12))
        async with self._connection() as db:
            await db.execute(
                f"INSERT INTO api_keys ({API_KEY_COLUMNS}) VALUES ({placeholders})", *api_key_row(key)
            )

    async def api_key(self, key_id: str) -> ApiKey | None:
        async with self._connection() as db:
            row = await db.fetchrow(f"SELECT {API_KEY_COLUMNS} FROM api_keys WHERE key_id = $1", key_id)
        return None if row is None else api_key_from_row(tuple(row))

    async def api_keys(self, account_id: str = "") -> list[ApiKey]:
        """The account's keys (every key for ""), oldest first, revoked and expired ones included."""
        async with self._connection() as db:
            rows = await db.fetch(
                f"SELECT {API_KEY_COLUMNS} FROM api_keys WHERE $1 = '' OR account_id = $1"
                " ORDER BY created_at_ms, key_id",
                account_id,
            )
        return [api_key_from_row(tuple(row)) for row in rows]

    async def revoke_api_key(self, key_id: str) -> ApiKey | None:
        """Revoke the key (a second revoke keeps the first time); None if there is no such key."""
        async with self._connection() as db:
            await db.execute(
                "UPDATE api_keys SET revoked_at_ms = $1 WHERE key_id = $2 AND revoked_at_ms = 0",
                self._clock_ms(),
                key_id,
            )
        return await self.api_key(key_id)

    async def touch_api_key(self, key_id: str, at_ms: int) -> None:
        async with self._connection() as db:
            await db.execute(
                "UPDATE api_keys SET last_used_at_ms = $1 WHERE key_id = $2 AND last_used_at_ms < $1",
                at_ms,
                key_id,
            )

    async def batch_api_key(self, batch_id: str) -> str:
        """The managed key a batch was queued with; "" for another key."""
        async with self._connection() as db:
            key_id = await db.fetchval("SELECT key_id FROM batch_api_keys WHERE batch_id = $1", batch_id)
        return key_id or ""

    # ------------------------------------------------------------------ stored responses

    async def put_response(self, account_id: str, response: StoredResponse) -> None:
        """Store ``response`` with its input items, replacing one of the same id; durable once this returns."""
        key = (account_id, response.response_id)
        items = response.input_items
        async with self._transaction() as db:
            await db.execute(
                "DELETE FROM stored_response_items WHERE account_id = $1 AND response_id = $2", *key
            )
            await db.execute(
                "INSERT INTO stored_responses (account_id, response_id, created_at, session_id, response)"
                " VALUES ($1, $2, $3, $4, $5) ON CONFLICT (account_id, response_id) DO UPDATE SET"
                " created_at = EXCLUDED.created_at, session_id = EXCLUDED.session_id, response = EXCLUDED.response",
                *key,
                response.created_at,
                response.session_id,
                response.body,
            )
            # One statement for the lot, however long the conversation.
            await db.execute(
                "INSERT INTO stored_response_items (account_id, response_id, position, item_id, item)"
                " SELECT $1, $2, position - 1, item_id, item"
                " FROM unnest($3::text[], $4::bytea[]) WITH ORDINALITY AS items (item_id, item, position)",
                *key,
                [item.item_id for item in items],
                [item.body for item in items],
            )

    async def response(
        self, account_id: str, response_id: str, *, with_items: bool = False
    ) -> StoredResponse | None:
        """The account's stored response of that id (None for another account's)."""
        key = (account_id, response_id)
        # One snapshot for both selects: a put committing between them is not half seen.
        async with self._connection() as db, db.transaction(isolation="repeatable_read", readonly=True):
            row = await db.fetchrow(
                "SELECT created_at, session_id, response FROM stored_responses"
                " WHERE account_id = $1 AND response_id = $2",
                *key,
            )
            if row is None:
                return None
            items = []
            if with_items:
                items = await db.fetch(
                    "SELECT item_id, item FROM stored_response_items"
                    " WHERE account_id = $1 AND response_id = $2 ORDER BY position",
                    *key,
                )
        return StoredResponse(response_id, *row, tuple(ResponseItem(*item) for item in items))

    async def delete_response(self, account_id: str, response_id: str) -> bool:
        """Forget the account's stored response and its items; False if it had none of that id."""
        async with self._transaction() as db:
            await db.execute(
                "DELETE FROM stored_response_items WHERE account_id = $1 AND response_id = $2",
                account_id,
                response_id,
            )
            status = await db.execute(
                "DELETE FROM stored_responses WHERE account_id = $1 AND response_id = $2",
                account_id,
                response_id,
            )
        return _affected(status) > 0

    async def response_items(
        self, account_id: str, response_id: str, *, newest_first: bool, after: str, limit: int
    ) -> tuple[list[ResponseItem], bool] | None:
        """Up to ``limit`` input items in the order asked, past the item ``after`` (none: from the
        first), and whether more follow; None when ``after`` names no item of that response."""
        direction, compare, pick = ("DESC", "<", "MAX") if newest_first else ("ASC", ">", "MIN")
        where = "account_id = $1 AND response_id = $2"
        async with self._connection() as db, db.transaction(isolation="repeatable_read", readonly=True):
            bound, args = "", [account_id, response_id]
            if after:
                start = await db.fetchval(
                    f"SELECT {pick}(position) FROM stored_response_items WHERE {where} AND item_id = $3",
                    *args,
                    after,
                )
                if start is None:
                    return None
                bound, args = f" AND position {compare} $3", [*args, start]
            rows = await db.fetch(
                f"SELECT item_id, item FROM stored_response_items WHERE {where}{bound}"
                f" ORDER BY position {direction} LIMIT ${len(args) + 1}",
                *args,
                limit + 1,
            )
        return [ResponseItem(*row) for row in rows[:limit]], len(rows) > limit

    # ------------------------------------------------------------------ plumbing

    def _connection(self) -> contextlib.AbstractAsyncContextManager[asyncpg.Connection]:
        """A pooled connection; a lost server reads as Unavailable."""
        return pooled_connection(self._pool, STORE)

    @contextlib.asynccontextmanager
    async def _transaction(self) -> AsyncIterator[asyncpg.Connection]:
        """A pooled connection in a transaction, committed when the block ends without an error."""
        async with self._connection() as connection, connection.transaction():
            yield connection


async def _end_unstarted_jobs(db: asyncpg.Connection, batch_id: str, result: bytes, now: int) -> int:
    """End (as ``cancelled``, with ``result``) the batch's jobs that are not running; how many."""
    status = await db.execute(
        f"UPDATE jobs SET state = 'cancelled', result = $1, finished_at_ms = $2, lease_owner = ''"
        f" WHERE batch_id = $3 AND {_RUNNABLE}",
        result,
        now,
        batch_id,
    )
    return _affected(status)


async def _finish_if_ended(db: asyncpg.Connection, batch_id: str, now: int) -> bool:
    """Mark the batch finished (and arm its webhook) when no job is left to end; True if this call did.

    The caller holds the batch's row lock, so every other end of its jobs has committed or waits.
    """
    unfinished = await db.fetchval(
        "SELECT EXISTS (SELECT 1 FROM jobs WHERE batch_id = $1 AND state IN ('queued', 'leased'))", batch_id
    )
    if unfinished:
        return False
    status = await db.execute(
        "UPDATE batches SET finished_at_ms = $1,"
        " webhook_state = CASE WHEN webhook_url = '' THEN '' ELSE 'pending' END, webhook_due_at_ms = $1"
        " WHERE batch_id = $2 AND finished_at_ms IS NULL",
        now,
        batch_id,
    )
    return _affected(status) == 1


async def _insert_file_batch(
    db: asyncpg.Connection, batch_id: str, account_id: str, record: FileBatchRecord
) -> None:
    await db.execute(
        "INSERT INTO file_batches (batch_id, account_id, input_file_id, endpoint, completion_window, metadata,"
        " custom_ids, rejected) VALUES ($1, $2, $3, $4, $5, $6, $7, $8)",
        batch_id,
        account_id,
        record.input_file_id,
        record.endpoint,
        record.completion_window,
        json.dumps(record.metadata),
        json.dumps(record.custom_ids),
        json.dumps([list(line) for line in record.rejected]),
    )
