"""The ledgers the usage tests run against, each with a way to reach its table behind its back."""

from __future__ import annotations

import sqlite3
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import asyncpg

from cachet.usage.ledger import Ledger
from cachet.usage.postgres_ledger import PostgresLedger
from cachet.usage.sqlite_ledger import SqliteLedger


@dataclass(frozen=True)
class LedgerBackend:
    """Opens ledgers on one test's database: each call is another process's connection to it."""

    name: str
    open: Callable[[], Awaitable[Ledger]]
    # Runs one statement on a connection of its own, as an operator's client would.
    execute_directly: Callable[[str], Awaitable[None]]
    # What the database raises for a statement it refuses.
    refusal: type[Exception]
    # The settings a usage service needs to use this database.
    settings: dict[str, object]


def sqlite_backend(path: Path) -> LedgerBackend:
    async def execute_directly(statement: str) -> None:
        connection = sqlite3.connect(path)
        try:
            connection.execute(statement)
        finally:
            connection.close()

    return LedgerBackend(
        "sqlite",
        lambda: SqliteLedger.open(path),
        execute_directly,
        sqlite3.IntegrityError,
        {"database": path},
    )


def postgres_backend(url: str) -> LedgerBackend:
    async def execute_directly(statement: str) -> None:
        connection = await asyncpg.connect(url)
        try:
            await connection.execute(statement)
        finally:
            await connection.close()

    return LedgerBackend(
        "postgresql",
        lambda: PostgresLedger.open(url),
        execute_directly,
        asyncpg.RaiseError,
        {"store_url": url},
    )
