"""The SQLite files that hold what a user would miss after a restart (usage ledger, queue).

Both want the same guarantees, so they open their files the same way: autocommit
(multi-statement writes open their own BEGIN IMMEDIATE), WAL, FULL fsync so an
acknowledged write survives a power cut and not only a crash, a busy timeout
for a second process holding the write lock a moment, and a schema version
checked on every open. And both reach their file the same way, through one
``SqliteWorker``.
"""

from __future__ import annotations

import asyncio
import functools
import re
import sqlite3
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")


def open_durable_sqlite(
    path: Path, schema: str, schema_version: int, *, what: str, check_same_thread: bool = True
) -> sqlite3.Connection:
    """Open (creating if needed) ``path`` with ``schema``; RuntimeError on another schema version."""
    path.parent.mkdir(parents=True, exist_ok=True)
    connection = sqlite3.connect(path, isolation_level=None, check_same_thread=check_same_thread)
    connection.execute("PRAGMA journal_mode=WAL")
    connection.execute("PRAGMA synchronous=FULL")
    connection.execute("PRAGMA busy_timeout=10000")
    connection.executescript(schema)
    version = connection.execute("PRAGMA user_version").fetchone()[0]
    if version == 0:
        connection.execute(f"PRAGMA user_version={schema_version}")
    elif version != schema_version:
        connection.close()
        raise RuntimeError(f"{path} has {what} schema version {version}; this build knows {schema_version}")
    return connection


class SqliteWorker:
    """One thread that owns one SQLite connection; the event loop only awaits it.

    SQLite is blocking, so every call runs on the worker's one thread, where the
    connection is made too. One writer is all SQLite allows anyway, and WAL keeps other
    processes' readers unblocked. A call whose caller is cancelled still finishes on the
    worker: a committed write is then found by the caller's retry, never half done.
    Open with ``start`` (blocking) or ``open`` (awaited).
    """

    def __init__(self, executor: ThreadPoolExecutor, connection: sqlite3.Connection) -> None:
        self._executor = executor
        # Only the worker's thread uses it, except where a test hooks it to count statements.
        self.connection = connection

    @classmethod
    def start(cls, connect: Callable[[], sqlite3.Connection], *, name: str) -> SqliteWorker:
        """A worker whose connection ``connect`` made on its thread; blocks until it has."""
        executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
        try:
            connection = executor.submit(connect).result()
        except BaseException:
            executor.shutdown(wait=False)
            raise
        return cls(executor, connection)

    @classmethod
    async def open(cls, connect: Callable[[], sqlite3.Connection], *, name: str) -> SqliteWorker:
        """``start`` without blocking the event loop."""
        executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
        try:
            connection = await asyncio.get_running_loop().run_in_executor(executor, connect)
        except BaseException:
            executor.shutdown(wait=False)
            raise
        return cls(executor, connection)

    async def run(self, function: Callable[[sqlite3.Connection], T]) -> T:
        """``function(connection)`` on the worker (autocommit: each statement its own transaction)."""
        return await asyncio.get_running_loop().run_in_executor(self._executor, function, self.connection)

    async def write(self, function: Callable[[sqlite3.Connection], T]) -> T:
        """``function`` in one write transaction: BEGIN IMMEDIATE takes the write lock up front, so
        what it reads stays true until it commits, even against another process."""
        return await self.run(functools.partial(_in_transaction, function, "BEGIN IMMEDIATE"))

    async def read(self, function: Callable[[sqlite3.Connection], T]) -> T:
        """``function`` in one read transaction: every select it makes sees one snapshot."""
        return await self.run(functools.partial(_in_transaction, function, "BEGIN"))

    def run_blocking(self, function: Callable[[sqlite3.Connection], T], timeout: float) -> T:
        """``run`` for a thread that is not the event loop's (a metrics scrape)."""
        return self._executor.submit(function, self.connection).result(timeout)

    async def close(self) -> None:
        """Close the connection (a WAL checkpoint folds the log back into the main file), then the thread."""
        await self.run(sqlite3.Connection.close)
        self._executor.shutdown(wait=True)


def _in_transaction(function: Callable[[sqlite3.Connection], T], begin: str, db: sqlite3.Connection) -> T:
    db.execute(begin)
    try:
        value = function(db)
    except BaseException:
        db.execute("ROLLBACK")
        raise
    db.execute("COMMIT")
    return value


@functools.cache
def for_sqlite(sql: str) -> str:
    """A statement written for PostgreSQL (parameters ``$1``, ``$2``) in SQLite's spelling (``?1``,
    ``?2``: numbered too, bound from the same tuple), so that both stores run one text."""
    return re.sub(r"\$(\d+)", r"?\1", sql)
