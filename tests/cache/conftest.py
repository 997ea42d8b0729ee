"""Fixtures of the cache service tests."""

from __future__ import annotations

import pytest
from scripted_kv_events import start_scripted


@pytest.fixture
async def scripted():
    servicer, running = await start_scripted()
    yield servicer, running
    await running.stop(grace=None)
