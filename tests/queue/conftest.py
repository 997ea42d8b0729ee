"""Queue test fixtures: a settable clock, and a queue store driven by it on each database.

``queue_backend`` (and ``store``, opened on it) runs a test once on a real SQLite file
and once on a schema of its own on the real PostgreSQL server.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from queue_backends import QueueBackend, postgres_backend, sqlite_backend
from settable_clock import Clock

from cachet.router.queue_store import QueueStore


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture(params=["sqlite", "postgresql"])
def queue_backend(request: pytest.FixtureRequest, tmp_path: Path) -> QueueBackend:
    if request.param == "sqlite":
        return sqlite_backend(tmp_path / "queue.sqlite3")
    return postgres_backend(request.getfixturevalue("postgres_url"))


@pytest.fixture
async def store(queue_backend: QueueBackend, clock: Clock) -> AsyncIterator[QueueStore]:
    opened = await queue_backend.open(clock)
    yield opened
    await opened.close()
