"""A schema of its own per test on the PostgreSQL server the tests run against.

Every development and CI machine runs one on 127.0.0.1:5432 (trust auth, role ``root``,
database ``test``); ``CACHET_TEST_POSTGRES_URL`` points the tests at another. Each test
session names its schemas ``cachet_test_<pid>_<random>_<n>`` and drops them all at its
end, so parallel sessions (two checkouts, CI beside a developer) never see each other's
rows. A store reaches its schema through the URL (``?search_path=...``, which asyncpg
passes to the server as a setting), as a deployment would name a schema of its own.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import uuid
from collections.abc import Coroutine
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar
from urllib.parse import urlsplit

import asyncpg
import pytest

T = TypeVar("T")

DEFAULT_URL = "postgresql://root@127.0.0.1:5432/test"
URL = os.environ.get("CACHET_TEST_POSTGRES_URL", DEFAULT_URL)

HOW_TO_FIX = (
    f"the PostgreSQL tests need a server at {URL} (every dev and CI machine runs one on "
    "127.0.0.1:5432: trust auth, role root, database test); start it, or set "
    "CACHET_TEST_POSTGRES_URL=postgresql://user@host:port/database to use another"
)


def run_alone(coroutine: Coroutine[Any, Any, T]) -> T:
    """Run ``coroutine`` to its end on a loop of its own, in a thread of its own: the caller
    may be a fixture called while a test's event loop runs."""
    with ThreadPoolExecutor(max_workers=1) as thread:
        return thread.submit(asyncio.run, coroutine).result()


class SessionSchemas:
    """Makes and drops the schemas of one test session."""

    def __init__(self) -> None:
        self.prefix = f"cachet_test_{os.getpid()}_{uuid.uuid4().hex[:8]}"
        self._numbers = itertools.count()

    async def check_server(self) -> None:
        """Fail the test with ``HOW_TO_FIX`` when the server cannot be reached (never a skip)."""
        try:
            connection = await asyncpg.connect(URL, timeout=5)
        except (OSError, asyncpg.PostgresError, TimeoutError) as error:
            pytest.fail(f"{HOW_TO_FIX} ({error})", pytrace=False)
        await connection.close()

    async def create(self) -> str:
        """A new, empty schema; returns the URL that makes it a connection's search path."""
        schema = f"{self.prefix}_{next(self._numbers)}"
        await self._execute(f'CREATE SCHEMA "{schema}"')
        separator = "&" if urlsplit(URL).query else "?"
        return f"{URL}{separator}search_path={schema}"

    async def drop(self, url: str) -> None:
        schema = url.rsplit("search_path=", 1)[1]
        await self._execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')

    def create_now(self) -> str:
        """``create`` (after ``check_server``) for a fixture that is not async (one shared by a module)."""
        run_alone(self.check_server())
        return run_alone(self.create())

    def drop_now(self, url: str) -> None:
        run_alone(self.drop(url))

    def drop_all_now(self) -> None:
        """Drop every schema this session made (at its end)."""
        if next(self._numbers) == 0:
            return  # it made none (no PostgreSQL test ran, or none reached the server)

        async def drop_all() -> None:
            connection = await asyncpg.connect(URL, timeout=5)
            try:
                names = await connection.fetch(
                    "SELECT nspname FROM pg_namespace WHERE starts_with(nspname, $1)", self.prefix + "_"
                )
                for (name,) in names:
                    await connection.execute(f'DROP SCHEMA IF EXISTS "{name}" CASCADE')
            finally:
                await connection.close()

        run_alone(drop_all())

    async def _execute(self, statement: str) -> None:
        connection = await asyncpg.connect(URL, timeout=5)
        try:
            await connection.execute(statement)
        finally:
            await connection.close()
