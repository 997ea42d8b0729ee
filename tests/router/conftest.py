"""Fixtures of the router tests: the whole request path as real processes (see service_processes)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from service_processes import ENGINE_SERVER_BUILT, TINY_MODEL_ID, CachetStack

from cachet.models.tiny import write_tiny_model


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[CachetStack]:
    """The whole request path, shared by one test module (each test uses its own ids)."""
    if not ENGINE_SERVER_BUILT:
        pytest.skip("the engine server (cachet.engine.main) is not built yet")
    root = tmp_path_factory.mktemp("router-e2e")
    running = CachetStack(root, write_tiny_model(root / TINY_MODEL_ID)).start()
    yield running
    running.stop()
    # Shown only when something in the module failed (pytest captures it otherwise).
    print(running.logs())
