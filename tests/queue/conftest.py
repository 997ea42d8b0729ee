"""Queue test fixtures: a settable clock and a QueueStore on a real SQLite file driven by it."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from settable_clock import Clock

from cachet.router.queue_store import QueueStore


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
async def store(tmp_path: Path, clock: Clock) -> AsyncIterator[QueueStore]:
    opened = QueueStore(tmp_path / "queue.sqlite3", clock_ms=clock)
    yield opened
    await opened.close()
