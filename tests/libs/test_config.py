from pathlib import Path

import pytest
from pydantic import ValidationError

from cachet.bridge.settings import BridgeSettings
from cachet.engine.settings import EngineSettings
from cachet.tokenizer.settings import TokenizerSettings


def test_shared_knobs_keep_their_documented_names(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CACHET_DATA_DIR", "/tmp/cachet-data")
    monkeypatch.setenv("CACHET_PORT", "9123")
    monkeypatch.setenv("CACHET_TP", "2")
    monkeypatch.setenv("CACHET_DTYPE", "float32")
    monkeypatch.setenv("CACHET_MODEL", "/models/x")
    assert BridgeSettings().port == 9123
    engine = EngineSettings()
    assert (engine.tensor_parallel_size, engine.dtype, engine.model) == (2, "float32", "/models/x")
    assert TokenizerSettings().data_dir == Path("/tmp/cachet-data")


def test_service_knobs_carry_the_service_name(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CACHET_TOKENIZER_PORT", "6001")
    monkeypatch.setenv("CACHET_ENGINE_MAX_NUM_SEQS", "7")
    assert TokenizerSettings().port == 6001
    assert EngineSettings().max_num_seqs == 7


def test_settings_are_frozen_and_validated(monkeypatch: pytest.MonkeyPatch) -> None:
    settings = TokenizerSettings(port=0)
    with pytest.raises(ValidationError):
        settings.port = 5  # type: ignore[misc]
    monkeypatch.setenv("CACHET_DTYPE", "float64")
    with pytest.raises(ValidationError, match="CACHET_DTYPE"):
        EngineSettings()
