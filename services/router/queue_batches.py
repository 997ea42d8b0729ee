"""Queued batches: creating one with its jobs, reading it back, and ending it early (cancel, expiry).

``create_batch`` stores a batch and one job per request in one transaction, so the
batch is durable once the call returns. ``cancel_batch`` and ``expire_file_batches``
end every job that has not started in one transaction, so the dispatcher can never
lease one of them afterwards; jobs already leased run to their end, and the last of
them finishes the batch (``finish_if_ended``, which completions call too). Both stores
run the same statements; PostgreSQL also locks the batch's row first, where SQLite's
one writer needs no lock.
"""

from __future__ import annotations

import sqlite3
import uuid
from collections.abc import Callable, Sequence

import asyncpg

from cachet.durable_postgres import PostgresPool, Row, rows_affected
from cachet.durable_sqlite import SqliteWorker, for_sqlite
from cachet.router.queue_api_keys import INSERT_BATCH_KEY
from cachet.router.queue_files import INSERT_FILE_BATCH, file_batch_row
from cachet.router.queue_records import BatchView, Cancellation, FileBatchRecord, batch_state

_INSERT_BATCH = (
    "INSERT INTO batches (batch_id, account_id, model, webhook_url, jobs, created_at_ms,"
    " finished_at_ms, webhook_state, webhook_due_at_ms) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9)"
)
_BATCH = (
    "SELECT model, webhook_url, webhook_state, created_at_ms, finished_at_ms, cancelled_at_ms,"
    " expired_at_ms FROM batches LEFT JOIN batch_cancellations USING (batch_id)"
    " LEFT JOIN batch_expirations USING (batch_id)"
    " WHERE batch_id = $1 AND account_id = $2"
)
# {result}: the result column, or a NULL of its type when the reader waits for the batch's end.
_JOB_STATES = "SELECT state, {result} FROM jobs WHERE batch_id = $1 ORDER BY position"
_FINISHED_AT = "SELECT finished_at_ms FROM batches WHERE batch_id = $1 AND account_id = $2"
_CANCELLED = "INSERT INTO batch_cancellations (batch_id, cancelled_at_ms) VALUES ($1, $2) ON CONFLICT (batch_id) DO NOTHING"
_OVERDUE = (
    "SELECT batch_id FROM file_batches JOIN batches USING (batch_id)"
    " WHERE finished_at_ms IS NULL AND created_at_ms <= $1"
    " AND batch_id NOT IN (SELECT batch_id FROM batch_expirations)"
    " AND batch_id NOT IN (SELECT batch_id FROM batch_cancellations)"
)
# A job is not running when it is queued, or leased by an owner whose lease has lapsed (its
# router died): it would only start again, so it ends too.
_END_UNSTARTED = (
    "UPDATE jobs SET state = 'cancelled', result = $1, finished_at_ms = $2, lease_owner = ''"
    " WHERE batch_id = $3 AND (state = 'queued' OR (state = 'leased' AND lease_expires_at_ms <= $2))"
)
# Two seeks into (batch_id, state), not a count over the batch: at the end of a large batch
# that count read every row of it for each completion.
_UNFINISHED = "SELECT EXISTS (SELECT 1 FROM jobs WHERE batch_id = $1 AND state IN ('queued', 'leased'))"
_FINISH = (
    "UPDATE batches SET finished_at_ms = $1,"
    " webhook_state = CASE WHEN webhook_url = '' THEN '' ELSE 'pending' END, webhook_due_at_ms = $1"
    " WHERE batch_id = $2 AND finished_at_ms IS NULL"
)


def _new_batch_id() -> str:
    return f"batch-{uuid.uuid4().hex}"


def _batch_row(batch_id: str, account_id: str, model: str, webhook_url: str, jobs: int, now: int) -> tuple:
    """``_INSERT_BATCH``'s parameters. A batch with no job (an OpenAI batch whose every line was
    refused) is finished at once, its webhook armed."""
    return (
        batch_id,
        account_id,
        model,
        webhook_url,
        jobs,
        now,
        None if jobs else now,
        "pending" if webhook_url and not jobs else "",
        now,
    )


def _batch_view(
    batch_id: str, account_id: str, row: Row, jobs: Sequence[Row], with_results: bool
) -> BatchView:
    model, webhook_url, webhook_state, created_at_ms, finished_at_ms, cancelled_at_ms, expired_at_ms = row
    states = [job[0] for job in jobs]
    return BatchView(
        batch_id,
        account_id,
        model,
        batch_state(finished_at_ms, cancelled_at_ms, expired_at_ms, states),
        [job[1] for job in jobs] if with_results else [],
        webhook_url,
        webhook_state,
        created_at_ms,
        finished_at_ms,
        cancelled_at_ms,
        states,
        expired_at_ms,
    )


class SqliteBatches:
    """The SQLite store's batches; ``SqliteQueueStore`` supplies the worker and the clock."""

    _worker: SqliteWorker
    _clock_ms: Callable[[], int]

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
        batch_id = _new_batch_id()
        now = self._clock_ms()

        def insert(db: sqlite3.Connection) -> None:
            db.execute(
                for_sqlite(_INSERT_BATCH),
                _batch_row(batch_id, account_id, model, webhook_url, len(bodies), now),
            )
            if file_batch is not None:
                db.execute(for_sqlite(INSERT_FILE_BATCH), file_batch_row(batch_id, account_id, file_batch))
            if api_key_id:
                db.execute(for_sqlite(INSERT_BATCH_KEY), (batch_id, api_key_id))
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

        await self._worker.write(insert)
        return batch_id

    async def batch(
        self, batch_id: str, account_id: str, *, results_once_finished: bool = False
    ) -> BatchView | None:
        """The batch if it exists *and* belongs to ``account_id``; else None (callers answer 404).

        ``results_once_finished`` leaves the results out while the batch runs: a poll of a
        running batch of a thousand jobs then reads their states, not every stored answer.
        """

        def read(db: sqlite3.Connection) -> BatchView | None:
            row = db.execute(for_sqlite(_BATCH), (batch_id, account_id)).fetchone()
            if row is None:
                return None
            with_results = not (results_once_finished and row[4] is None)
            states = for_sqlite(_JOB_STATES.format(result="result" if with_results else "NULL"))
            return _batch_view(
                batch_id, account_id, row, db.execute(states, (batch_id,)).fetchall(), with_results
            )

        return await self._worker.run(read)

    async def cancel_batch(
        self, batch_id: str, account_id: str, cancelled_result: bytes
    ) -> Cancellation | None:
        """End the batch's jobs that have not started, each with ``cancelled_result``; None if no such batch.

        A job counts as started while its lease is live. Cancelling a finished or already
        cancelled batch changes nothing.
        """

        def cancel(db: sqlite3.Connection) -> Cancellation | None:
            now = self._clock_ms()
            row = db.execute(for_sqlite(_FINISHED_AT), (batch_id, account_id)).fetchone()
            if row is None:
                return None
            if row[0] is not None:
                return Cancellation(cancelled_jobs=0, batch_finished=False)
            db.execute(for_sqlite(_CANCELLED), (batch_id, now))
            cancelled = sqlite_end_unstarted_jobs(db, batch_id, cancelled_result, now)
            return Cancellation(cancelled, batch_finished=sqlite_finish_if_ended(db, batch_id, now))

        return await self._worker.write(cancel)

    async def expire_file_batches(self, window_ms: int, expired_result: bytes) -> list[str]:
        """Expire every unfinished OpenAI batch created ``window_ms`` or longer ago.

        As a cancel: its jobs that have not started end with ``expired_result``, started
        ones run to their end. Returns the batches this call finished (their webhooks are
        armed). A batch cancelled first stays cancelled.
        """

        def expire(db: sqlite3.Connection) -> list[str]:
            now = self._clock_ms()
            finished = []
            for (batch_id,) in db.execute(for_sqlite(_OVERDUE), (now - window_ms,)).fetchall():
                db.execute(
                    "INSERT INTO batch_expirations (batch_id, expired_at_ms) VALUES (?, ?)", (batch_id, now)
                )
                sqlite_end_unstarted_jobs(db, batch_id, expired_result, now)
                if sqlite_finish_if_ended(db, batch_id, now):
                    finished.append(batch_id)
            return finished

        return await self._worker.write(expire)


def sqlite_end_unstarted_jobs(db: sqlite3.Connection, batch_id: str, result: bytes, now: int) -> int:
    """End (as ``cancelled``, with ``result``) the batch's jobs that are not running; how many."""
    return db.execute(for_sqlite(_END_UNSTARTED), (result, now, batch_id)).rowcount


def sqlite_finish_if_ended(db: sqlite3.Connection, batch_id: str, now: int) -> bool:
    """Mark the batch finished (and arm its webhook) when no job is left to end; True if this call did."""
    if db.execute(for_sqlite(_UNFINISHED), (batch_id,)).fetchone()[0]:
        return False
    return db.execute(for_sqlite(_FINISH), (now, batch_id)).rowcount == 1


class PostgresBatches:
    """The PostgreSQL store's batches; ``PostgresQueueStore`` supplies the pool and the clock."""

    _pool: PostgresPool
    _clock_ms: Callable[[], int]

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
        batch_id = _new_batch_id()
        now = self._clock_ms()
        async with self._pool.transaction() as db:
            await db.execute(
                _INSERT_BATCH, *_batch_row(batch_id, account_id, model, webhook_url, len(bodies), now)
            )
            if file_batch is not None:
                await db.execute(INSERT_FILE_BATCH, *file_batch_row(batch_id, account_id, file_batch))
            if api_key_id:
                await db.execute(INSERT_BATCH_KEY, batch_id, api_key_id)
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
        async with self._pool.connection() as db:
            row = await db.fetchrow(_BATCH, batch_id, account_id)
            if row is None:
                return None
            with_results = not (results_once_finished and row["finished_at_ms"] is None)
            jobs = await db.fetch(
                _JOB_STATES.format(result="result" if with_results else "NULL::bytea"), batch_id
            )
        return _batch_view(batch_id, account_id, tuple(row), jobs, with_results)

    async def cancel_batch(
        self, batch_id: str, account_id: str, cancelled_result: bytes
    ) -> Cancellation | None:
        """End the batch's jobs that have not started, each with ``cancelled_result``; None if no such batch."""
        now = self._clock_ms()
        async with self._pool.transaction() as db:
            row = await db.fetchrow(_FINISHED_AT + " FOR UPDATE", batch_id, account_id)
            if row is None:
                return None
            if row["finished_at_ms"] is not None:
                return Cancellation(cancelled_jobs=0, batch_finished=False)
            await db.execute(_CANCELLED, batch_id, now)
            cancelled = await postgres_end_unstarted_jobs(db, batch_id, cancelled_result, now)
            return Cancellation(cancelled, batch_finished=await postgres_finish_if_ended(db, batch_id, now))

    async def expire_file_batches(self, window_ms: int, expired_result: bytes) -> list[str]:
        """Expire every unfinished OpenAI batch created ``window_ms`` or longer ago; the ones this call finished."""
        now = self._clock_ms()
        finished = []
        async with self._pool.transaction() as db:
            for (batch_id,) in await db.fetch(_OVERDUE + " ORDER BY batch_id", now - window_ms):
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
                await postgres_end_unstarted_jobs(db, batch_id, expired_result, now)
                if await postgres_finish_if_ended(db, batch_id, now):
                    finished.append(batch_id)
        return finished


async def postgres_end_unstarted_jobs(db: asyncpg.Connection, batch_id: str, result: bytes, now: int) -> int:
    """End (as ``cancelled``, with ``result``) the batch's jobs that are not running; how many."""
    return rows_affected(await db.execute(_END_UNSTARTED, result, now, batch_id))


async def postgres_finish_if_ended(db: asyncpg.Connection, batch_id: str, now: int) -> bool:
    """Mark the batch finished (and arm its webhook) when no job is left to end; True if this call did.

    The caller holds the batch's row lock, so every other end of its jobs has committed or waits.
    """
    if await db.fetchval(_UNFINISHED, batch_id):
        return False
    return rows_affected(await db.execute(_FINISH, now, batch_id)) == 1
