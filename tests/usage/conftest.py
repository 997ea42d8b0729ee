"""Usage test fixtures: ``ledger_backend`` (and ``ledger``, opened on it) runs a test once on a
real SQLite file and once on a schema of its own on the real PostgreSQL server."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from ledger_backends import LedgerBackend, postgres_backend, sqlite_backend

from cachet.usage.ledger import Ledger


@pytest.fixture(params=["sqlite", "postgresql"])
def ledger_backend(request: pytest.FixtureRequest, tmp_path: Path) -> LedgerBackend:
    if request.param == "sqlite":
        return sqlite_backend(tmp_path / "usage.sqlite3")
    return postgres_backend(request.getfixturevalue("postgres_url"))


@pytest.fixture
async def ledger(ledger_backend: LedgerBackend) -> AsyncIterator[Ledger]:
    opened = await ledger_backend.open()
    yield opened
    await opened.close()
