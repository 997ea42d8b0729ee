"""Keys' last minutes counted in PostgreSQL, so routers sharing a store share each key's limits.

A key's use is kept per second (``key_window_use``: requests and tokens of one key in
one Unix second); the last sixty rows are its minute, read back as ``SlidingWindow``s,
so a row leaves the window up to a second before its last event would in memory. An
admission is one transaction under a per-key advisory lock: drop the key's rows that
left the minute, read the rest, count one request if both limits allow. Routers
admitting calls of one key therefore take turns, and of N concurrent calls exactly as
many as the limit pass; calls of other keys never wait on it. Tokens are added by an
upsert, which needs no lock. Its own migrations (store ``key_windows``) in the same
database as the queue; only keys with per-minute limits ever touch it.
"""

from __future__ import annotations

import asyncpg

from cachet.durable_postgres import describe, open_pool, pooled_connection
from cachet.logs import get_logger
from cachet.router.key_limits import WINDOW_MS, KeyUse

log = get_logger(__name__)

STORE = "key_windows"

MIGRATIONS = [
    (
        1,
        """
CREATE TABLE key_window_use (
    key_id TEXT NOT NULL,
    -- Unix second the counts belong to.
    second BIGINT NOT NULL,
    requests BIGINT NOT NULL DEFAULT 0,
    tokens BIGINT NOT NULL DEFAULT 0,
    PRIMARY KEY (key_id, second)
);
""",
    ),
]


class PostgresKeyWindows:
    """``KeyWindows`` in a database every router of the deployment shares."""

    def __init__(self, pool: asyncpg.Pool) -> None:
        # Use ``open``: it applies the migrations first.
        self._pool = pool

    @classmethod
    async def open(cls, url: str) -> PostgresKeyWindows:
        pool = await open_pool(url, MIGRATIONS, store=STORE, max_size=4)
        log.info("key windows opened", store="postgresql", database=describe(url))
        return cls(pool)

    async def admit(self, key_id: str, now_ms: int, rpm: int, tpm: int) -> tuple[bool, KeyUse]:
        second = now_ms // 1000
        async with pooled_connection(self._pool, STORE) as db, db.transaction():
            await db.execute("SELECT pg_advisory_xact_lock(hashtextextended($1, 0))", f"cachet.key.{key_id}")
            await db.execute(
                "DELETE FROM key_window_use WHERE key_id = $1 AND second <= $2",
                key_id,
                (now_ms - WINDOW_MS) // 1000,
            )
            rows = await db.fetch(
                "SELECT second, requests, tokens FROM key_window_use WHERE key_id = $1 ORDER BY second",
                key_id,
            )
            use = KeyUse()
            for row in rows:
                use.requests.add(row["second"] * 1000, row["requests"])
                use.tokens.add(row["second"] * 1000, row["tokens"])
            admitted = not any(use.over(rpm, tpm, now_ms))
            if admitted:
                await db.execute(
                    "INSERT INTO key_window_use (key_id, second, requests) VALUES ($1, $2, 1)"
                    " ON CONFLICT (key_id, second) DO UPDATE SET requests = key_window_use.requests + 1",
                    key_id,
                    second,
                )
                use.requests.add(now_ms, 1)
        return admitted, use

    async def add_tokens(self, key_id: str, now_ms: int, tokens: int) -> None:
        async with pooled_connection(self._pool, STORE) as db:
            await db.execute(
                "INSERT INTO key_window_use (key_id, second, tokens) VALUES ($1, $2, $3)"
                " ON CONFLICT (key_id, second) DO UPDATE SET tokens = key_window_use.tokens + $3",
                key_id,
                now_ms // 1000,
                tokens,
            )

    async def close(self) -> None:
        await self._pool.close()
