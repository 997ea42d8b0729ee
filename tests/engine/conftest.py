"""Fixtures of the engine tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from cachet.models.tiny import write_tiny_model


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A tiny dense (llama) and a tiny mixture-of-experts MLA (kimi-k2) checkpoint; read-only."""
    root = tmp_path_factory.mktemp("tiny-checkpoints")
    cache = root / "tok-cache"
    return {
        "llama": write_tiny_model(root / "llama", tokenizer_cache_dir=cache),
        "kimi-k2": write_tiny_model(root / "kimi", family="kimi-k2", tokenizer_cache_dir=cache),
    }
