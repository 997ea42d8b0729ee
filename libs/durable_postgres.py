"""The PostgreSQL databases that hold what a user would miss after a restart (queue, usage ledger).

The scale-out twin of ``durable_sqlite``: every router and usage process that shares
``CACHET_STORE_URL`` opens the same database the same way. A pool of asyncpg
connections (the driver is asyncio-native, so no worker thread sits between the
event loop and the server), then the store's *versioned* migrations: each store
(``queue``, ``ledger``) lists its schema changes in order, and those above the
version recorded in ``schema_migrations`` are applied in one transaction under
an advisory lock, so processes starting together apply each change once. A
database that a newer build migrated further is refused, as SQLite's version check
refuses a newer file.

Failures to reach the server while serving become ``Unavailable`` (UNAVAILABLE, HTTP
503, retry later): a router or ledger whose database is restarting is unable to answer
now, not broken, and a caller's retry is safe because every write is idempotent. At
start they are ``StoreNotOpened``, which the entry points report in one line.
"""

from __future__ import annotations

import contextlib
import zlib
from collections.abc import AsyncIterator, Sequence
from typing import Any, cast
from urllib.parse import urlsplit

import asyncpg

from cachet.errors import Unavailable

# Each store's migrations, version 1 first; a version, once released, is never edited.
Migrations = Sequence[tuple[int, str]]

# A row as either store reads it, for the row-to-domain conversions they share: sqlite3 gives
# tuples; an asyncpg Record indexes and iterates the same but is no Sequence.
Row = Sequence[Any] | asyncpg.Record

URL_SCHEMES = ("postgresql", "postgres")

# Errors that mean "the server is not there now", as opposed to a bad statement.
_UNREACHABLE = (
    OSError,
    TimeoutError,
    asyncpg.PostgresConnectionError,
    asyncpg.InterfaceError,
    asyncpg.CannotConnectNowError,
    asyncpg.AdminShutdownError,
)

_MIGRATIONS_TABLE = """
CREATE TABLE IF NOT EXISTS schema_migrations (
    store TEXT NOT NULL,
    version INTEGER NOT NULL,
    applied_at TIMESTAMPTZ NOT NULL DEFAULT now(),
    PRIMARY KEY (store, version)
)"""


class StoreNotOpened(Exception):
    """The store could not be opened at start: unreachable, or migrated by a newer build.

    A start-up condition an operator fixes (start the server, fix the URL, upgrade), so a
    service's entry point reports it in one line rather than as a traceback.
    """


def is_postgres_url(url: str) -> bool:
    return urlsplit(url).scheme in URL_SCHEMES


def describe(url: str) -> str:
    """``host:port/database`` of ``url``, never its password (for logs and errors)."""
    parts = urlsplit(url)
    host = parts.hostname or "localhost"
    return f"{host}:{parts.port or 5432}{parts.path or '/'}"


async def open_pool(url: str, migrations: Migrations, *, store: str, max_size: int = 8) -> asyncpg.Pool:
    """A pool on ``url`` with ``store``'s migrations applied; StoreNotOpened if the server cannot be reached."""
    try:
        pool = await asyncpg.create_pool(url, min_size=1, max_size=max_size, timeout=10)
    except _UNREACHABLE as error:
        raise StoreNotOpened(
            f"cannot reach the PostgreSQL {store} store at {describe(url)}: {error}"
        ) from error
    try:
        async with pool.acquire() as connection:
            await migrate(_as_connection(connection), migrations, store=store)
    except BaseException:
        await pool.close()
        raise
    return pool


async def migrate(connection: asyncpg.Connection, migrations: Migrations, *, store: str) -> int:
    """Apply ``store``'s migrations newer than the database's; returns the version now in force."""
    known = max(version for version, _ in migrations)
    async with connection.transaction():
        # One key per store, shared by every process: two starting at once apply in turn.
        await connection.execute("SELECT pg_advisory_xact_lock($1)", _lock_key(store))
        await connection.execute(_MIGRATIONS_TABLE)
        applied = await connection.fetchval(
            "SELECT COALESCE(MAX(version), 0) FROM schema_migrations WHERE store = $1", store
        )
        if applied > known:
            raise StoreNotOpened(
                f"the {store} store in this database has schema version {applied}; this build knows {known}"
            )
        for version, statements in sorted(migrations):
            if version > applied:
                await connection.execute(statements)
                await connection.execute(
                    "INSERT INTO schema_migrations (store, version) VALUES ($1, $2)", store, version
                )
    return known


def connection_lost(error: BaseException) -> bool:
    """Whether ``error`` says the connection or the server is gone (not that a statement was refused)."""
    # asyncpg raises InternalClientError ("cannot switch to state ...") for a query sent on a
    # connection the server cut while it sat idle in the pool (pg_terminate_backend, failover).
    return isinstance(error, (*_UNREACHABLE, asyncpg.InternalClientError))


@contextlib.asynccontextmanager
async def pooled_connection(pool: asyncpg.Pool, store: str) -> AsyncIterator[asyncpg.Connection]:
    """A connection of ``pool``. A lost server reads as Unavailable naming ``store``, and a
    connection it cut is closed, so that the pool opens a fresh one for the next caller."""
    try:
        async with pool.acquire() as connection:
            try:
                yield _as_connection(connection)
            except BaseException as error:
                if connection_lost(error):
                    connection.terminate()
                raise
    except Exception as error:
        if connection_lost(error):
            raise Unavailable(f"the {store} store (PostgreSQL) is unreachable: {error}") from error
        raise


def _as_connection(proxy: asyncpg.pool.PoolConnectionProxy) -> asyncpg.Connection:
    # A pool lends a proxy that forwards every Connection method to the connection it wraps;
    # asyncpg-stubs types the two apart, and every caller here wants the Connection's API.
    return cast(asyncpg.Connection, proxy)


def _lock_key(store: str) -> int:
    return zlib.crc32(f"cachet.migrations.{store}".encode())


class PostgresPool:
    """One store's pooled connections, each borrowed for one block: a lost server reads as
    Unavailable naming the store (``pooled_connection``)."""

    def __init__(self, pool: asyncpg.Pool, store: str) -> None:
        self._pool = pool
        self.store = store

    def connection(self) -> contextlib.AbstractAsyncContextManager[asyncpg.Connection]:
        return pooled_connection(self._pool, self.store)

    @contextlib.asynccontextmanager
    async def transaction(self) -> AsyncIterator[asyncpg.Connection]:
        """A connection in a transaction, committed when the block ends without an error."""
        async with self.connection() as connection, connection.transaction():
            yield connection

    @contextlib.asynccontextmanager
    async def snapshot(self) -> AsyncIterator[asyncpg.Connection]:
        """A connection in a read-only transaction whose every select sees one snapshot."""
        async with (
            self.connection() as connection,
            connection.transaction(isolation="repeatable_read", readonly=True),
        ):
            yield connection

    async def close(self) -> None:
        await self._pool.close()


def rows_affected(status: str) -> int:
    """Rows a statement changed, from its command tag ("UPDATE 3")."""
    return int(status.rsplit(" ", 1)[1])
