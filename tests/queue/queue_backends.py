"""The queue stores the queue tests run against: each test once on SQLite and once on PostgreSQL."""

from __future__ import annotations

import sqlite3
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import asyncpg

from cachet.router.postgres_queue_store import PostgresQueueStore
from cachet.router.queue_store import QueueStore
from cachet.router.sqlite_queue_store import SqliteQueueStore

Clock = Callable[[], int] | None


@dataclass(frozen=True)
class QueueBackend:
    """Opens stores on one test's database: each call is another router's connection to it."""

    name: str
    open: Callable[[Clock], Awaitable[QueueStore]]
    # What a write the database refuses raises.
    write_error: type[Exception]


def sqlite_backend(path: Path) -> QueueBackend:
    async def open_store(clock: Clock = None) -> QueueStore:
        return SqliteQueueStore(path) if clock is None else SqliteQueueStore(path, clock_ms=clock)

    return QueueBackend("sqlite", open_store, sqlite3.Error)


def postgres_backend(url: str) -> QueueBackend:
    async def open_store(clock: Clock = None) -> QueueStore:
        return await (PostgresQueueStore.open(url) if clock is None else PostgresQueueStore.open(url, clock))

    return QueueBackend("postgresql", open_store, asyncpg.PostgresError)
