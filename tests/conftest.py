"""Shared by every test folder.

pytest puts tests/ on sys.path for this conftest, so ``from service_processes
import start_service`` works anywhere (real processes over loopback).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

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
