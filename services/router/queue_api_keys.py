"""Managed API keys (api_keys.py) in the queue's database, and the key each batch was queued with.

A batch's jobs count against the limits of the key it was queued with when they run,
so that key is kept beside the batch. Both stores run the same statements.
"""

from __future__ import annotations

from collections.abc import Callable

from cachet.durable_postgres import PostgresPool
from cachet.durable_sqlite import SqliteWorker, for_sqlite
from cachet.router.api_keys import API_KEY_COLUMNS, ApiKey, api_key_from_row, api_key_row

_CREATE = f"INSERT INTO api_keys ({API_KEY_COLUMNS}) VALUES ({', '.join(f'${n}' for n in range(1, 12))})"
_BY_ID = f"SELECT {API_KEY_COLUMNS} FROM api_keys WHERE key_id = $1"
# Every key for account '', oldest first, revoked and expired ones included.
_OF_ACCOUNT = (
    f"SELECT {API_KEY_COLUMNS} FROM api_keys WHERE $1 = '' OR account_id = $1 ORDER BY created_at_ms, key_id"
)
# A second revoke keeps the first time.
_REVOKE = "UPDATE api_keys SET revoked_at_ms = $1 WHERE key_id = $2 AND revoked_at_ms = 0"
_TOUCH = "UPDATE api_keys SET last_used_at_ms = $1 WHERE key_id = $2 AND last_used_at_ms < $1"
_BATCH_KEY = "SELECT key_id FROM batch_api_keys WHERE batch_id = $1"
INSERT_BATCH_KEY = "INSERT INTO batch_api_keys (batch_id, key_id) VALUES ($1, $2)"


class SqliteApiKeys:
    """The SQLite store's keys; ``SqliteQueueStore`` supplies the worker and the clock."""

    _worker: SqliteWorker
    _clock_ms: Callable[[], int]

    async def create_api_key(self, key: ApiKey) -> None:
        await self._worker.run(lambda db: db.execute(for_sqlite(_CREATE), api_key_row(key)))

    async def api_key(self, key_id: str) -> ApiKey | None:
        row = await self._worker.run(lambda db: db.execute(for_sqlite(_BY_ID), (key_id,)).fetchone())
        return None if row is None else api_key_from_row(row)

    async def api_keys(self, account_id: str = "") -> list[ApiKey]:
        """The account's keys (every key for ""), oldest first, revoked and expired ones included."""
        rows = await self._worker.run(
            lambda db: db.execute(for_sqlite(_OF_ACCOUNT), (account_id,)).fetchall()
        )
        return [api_key_from_row(row) for row in rows]

    async def revoke_api_key(self, key_id: str) -> ApiKey | None:
        """Revoke the key (a second revoke keeps the first time); None if there is no such key."""
        now = self._clock_ms()
        await self._worker.run(lambda db: db.execute(for_sqlite(_REVOKE), (now, key_id)))
        return await self.api_key(key_id)

    async def touch_api_key(self, key_id: str, at_ms: int) -> None:
        await self._worker.run(lambda db: db.execute(for_sqlite(_TOUCH), (at_ms, key_id)))

    async def batch_api_key(self, batch_id: str) -> str:
        """The managed key a batch was queued with; "" for another key."""
        row = await self._worker.run(lambda db: db.execute(for_sqlite(_BATCH_KEY), (batch_id,)).fetchone())
        return "" if row is None else row[0]


class PostgresApiKeys:
    """The PostgreSQL store's keys; ``PostgresQueueStore`` supplies the pool and the clock."""

    _pool: PostgresPool
    _clock_ms: Callable[[], int]

    async def create_api_key(self, key: ApiKey) -> None:
        async with self._pool.connection() as db:
            await db.execute(_CREATE, *api_key_row(key))

    async def api_key(self, key_id: str) -> ApiKey | None:
        async with self._pool.connection() as db:
            row = await db.fetchrow(_BY_ID, key_id)
        return None if row is None else api_key_from_row(tuple(row))

    async def api_keys(self, account_id: str = "") -> list[ApiKey]:
        """The account's keys (every key for ""), oldest first, revoked and expired ones included."""
        async with self._pool.connection() as db:
            rows = await db.fetch(_OF_ACCOUNT, account_id)
        return [api_key_from_row(tuple(row)) for row in rows]

    async def revoke_api_key(self, key_id: str) -> ApiKey | None:
        """Revoke the key (a second revoke keeps the first time); None if there is no such key."""
        async with self._pool.connection() as db:
            await db.execute(_REVOKE, self._clock_ms(), key_id)
        return await self.api_key(key_id)

    async def touch_api_key(self, key_id: str, at_ms: int) -> None:
        async with self._pool.connection() as db:
            await db.execute(_TOUCH, at_ms, key_id)

    async def batch_api_key(self, batch_id: str) -> str:
        """The managed key a batch was queued with; "" for another key."""
        async with self._pool.connection() as db:
            key_id = await db.fetchval(_BATCH_KEY, batch_id)
        return key_id or ""
