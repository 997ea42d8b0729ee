"""The queue's webhook deliveries: which finished batch is due a POST, and every attempt made.

A batch with a webhook is armed (``webhook_state = 'pending'``) by the call that
finishes it. ``claim_webhook`` pushes a due delivery's time ahead, which is the
sender's lease on it: a sender that dies leaves it due again. Both stores run the same
statements; PostgreSQL's claim skips a delivery another router is claiming.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable

from cachet.durable_postgres import PostgresPool
from cachet.durable_sqlite import SqliteWorker, for_sqlite
from cachet.router.queue_records import DueWebhook, WebhookAttempt

_DUE = (
    "SELECT batch_id, account_id, webhook_url, finished_at_ms FROM batches"
    " WHERE webhook_state = 'pending' AND webhook_due_at_ms <= $1"
    " ORDER BY webhook_due_at_ms LIMIT 1"
)
_DUE_AT = "UPDATE batches SET webhook_due_at_ms = $1 WHERE batch_id = $2"
_ATTEMPT_COUNT = "SELECT COUNT(*) FROM webhook_attempts WHERE batch_id = $1"
_RECORD_ATTEMPT = (
    "INSERT INTO webhook_attempts (batch_id, attempt, at_ms, http_status, error)"
    " SELECT $1, COALESCE(MAX(attempt), 0) + 1, $2, $3, $4 FROM webhook_attempts WHERE batch_id = $1"
)
_DELIVERED = "UPDATE batches SET webhook_state = 'delivered' WHERE batch_id = $1"
_GIVEN_UP = "UPDATE batches SET webhook_state = 'failed' WHERE batch_id = $1"
_ATTEMPTS = (
    "SELECT attempt, at_ms, http_status, error FROM webhook_attempts WHERE batch_id = $1 ORDER BY attempt"
)


def _after_attempt(batch_id: str, *, delivered: bool, retry_at_ms: int | None) -> tuple[str, tuple]:
    """The batch's update once an attempt is recorded: delivered, given up (no retry), or due again."""
    if delivered:
        return _DELIVERED, (batch_id,)
    if retry_at_ms is None:
        return _GIVEN_UP, (batch_id,)
    return _DUE_AT, (retry_at_ms, batch_id)


class SqliteWebhooks:
    """The SQLite store's deliveries; ``SqliteQueueStore`` supplies the worker and the clock."""

    _worker: SqliteWorker
    _clock_ms: Callable[[], int]

    async def claim_webhook(self, hold_seconds: float) -> DueWebhook | None:
        """Take one due delivery, pushing its due time ``hold_seconds`` ahead (a lease on sending it)."""

        def claim(db: sqlite3.Connection) -> DueWebhook | None:
            now = self._clock_ms()
            row = db.execute(for_sqlite(_DUE), (now,)).fetchone()
            if row is None:
                return None
            db.execute(for_sqlite(_DUE_AT), (now + int(hold_seconds * 1000), row[0]))
            attempts = db.execute(for_sqlite(_ATTEMPT_COUNT), (row[0],)).fetchone()[0]
            return DueWebhook(*row, attempts=attempts)  # type: ignore[misc]  # mypy cannot count a starred _DUE row

        return await self._worker.write(claim)

    async def record_webhook_attempt(
        self, batch_id: str, http_status: int, error: str, *, delivered: bool, retry_at_ms: int | None
    ) -> None:
        """Append one attempt; then the delivery is done, due again at ``retry_at_ms``, or given up (None)."""
        then, arguments = _after_attempt(batch_id, delivered=delivered, retry_at_ms=retry_at_ms)

        def record(db: sqlite3.Connection) -> None:
            db.execute(for_sqlite(_RECORD_ATTEMPT), (batch_id, self._clock_ms(), http_status, error))
            db.execute(for_sqlite(then), arguments)

        await self._worker.write(record)

    async def webhook_attempts(self, batch_id: str) -> list[WebhookAttempt]:
        rows = await self._worker.run(lambda db: db.execute(for_sqlite(_ATTEMPTS), (batch_id,)).fetchall())
        return [WebhookAttempt(*row) for row in rows]


class PostgresWebhooks:
    """The PostgreSQL store's deliveries; ``PostgresQueueStore`` supplies the pool and the clock."""

    _pool: PostgresPool
    _clock_ms: Callable[[], int]

    async def claim_webhook(self, hold_seconds: float) -> DueWebhook | None:
        """Take one due delivery, pushing its due time ``hold_seconds`` ahead (a lease on sending it)."""
        now = self._clock_ms()
        async with self._pool.transaction() as db:
            # A delivery another router is claiming right now is skipped, never sent twice.
            row = await db.fetchrow(_DUE + " FOR UPDATE SKIP LOCKED", now)
            if row is None:
                return None
            await db.execute(_DUE_AT, now + int(hold_seconds * 1000), row["batch_id"])
            attempts = await db.fetchval(_ATTEMPT_COUNT, row["batch_id"])
        return DueWebhook(*row, attempts=attempts)  # type: ignore[misc]  # mypy cannot count a starred _DUE row

    async def record_webhook_attempt(
        self, batch_id: str, http_status: int, error: str, *, delivered: bool, retry_at_ms: int | None
    ) -> None:
        """Append one attempt; then the delivery is done, due again at ``retry_at_ms``, or given up (None)."""
        then, arguments = _after_attempt(batch_id, delivered=delivered, retry_at_ms=retry_at_ms)
        async with self._pool.transaction() as db:
            await db.execute(_RECORD_ATTEMPT, batch_id, self._clock_ms(), http_status, error)
            await db.execute(then, *arguments)

    async def webhook_attempts(self, batch_id: str) -> list[WebhookAttempt]:
        async with self._pool.connection() as db:
            rows = await db.fetch(_ATTEMPTS, batch_id)
        return [WebhookAttempt(*row) for row in rows]
