"""Shared by every test folder.

pytest puts tests/ on sys.path for this conftest, so ``from service_processes
import start_service`` works anywhere (real processes over loopback).
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from postgres_schemas import SessionSchemas

from cachet.models.catalog import DEFAULT_MODEL_ID, ensure_default_model

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    """The converted default model where `cachet` keeps it (<CACHET_DATA_DIR or ./data>/models/<id>).

    Converted on first use (about a minute, under a file lock), so a developer's
    existing conversion and every later test session reuse it.
    """
    data_dir = Path(os.environ.get("CACHET_DATA_DIR") or ROOT / "data")
    path = ensure_default_model(data_dir)
    assert path.name == DEFAULT_MODEL_ID
    return path


@pytest.fixture(scope="session")
def postgres_schemas() -> Iterator[SessionSchemas]:
    """This session's schemas on the test PostgreSQL server, all dropped when the session ends."""
    schemas = SessionSchemas()
    yield schemas
    schemas.drop_all_now()


@pytest.fixture
async def postgres_url(postgres_schemas: SessionSchemas) -> AsyncIterator[str]:
    """A URL whose connections see an empty schema of this test's own (dropped after it).

    No server fails the test with how to point it at one: it never skips silently.
    """
    await postgres_schemas.check_server()
    url = await postgres_schemas.create()
    yield url
    await postgres_schemas.drop(url)
