"""Loads Hugging Face safetensors checkpoints into the engine's own model code.

The model is built on the meta device (no memory, no random init), materialised
empty on the target device in the target dtype, and then every parameter is
filled from the checkpoint, one tensor at a time, so peak host memory stays at
one tensor rather than one model. A tensor-parallel rank's model is built with
its own slices' shapes, and the loader reads only those slices (safetensors
``get_slice``): no rank ever holds a weight it does not own. Anything the
checkpoint lacks or has in excess is an error: a silently half-loaded model
produces fluent garbage.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from cachet.engine.models import ModelConfig, model_class
from cachet.engine.tensor_parallel import (
    SINGLE_RANK,
    TensorParallelRank,
    TensorSlice,
    checkpoint_slices,
    stacked_checkpoint_parts,
)

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# Older exports saved RoPE tables as state; the model recomputes them.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class CheckpointError(ValueError):
    """The checkpoint cannot fill the model; the message names the tensors."""


def checkpoint_files(model_dir: Path) -> list[Path]:
    model_dir = Path(model_dir)
    index = model_dir / INDEX_FILE
    if index.exists():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        files = [model_dir / name for name in sorted(set(weight_map.values()))]
        absent = [f.name for f in files if not f.exists()]
        if absent:
            raise CheckpointError(f"{INDEX_FILE} names shards that are missing: {absent}")
        return files
    if (model_dir / SINGLE_FILE).exists():
        return [model_dir / SINGLE_FILE]
    raise CheckpointError(f"no {SINGLE_FILE} or {INDEX_FILE} in {model_dir}")


def load_model(
    model_dir: Path,
    config: ModelConfig,
    *,
    dtype: torch.dtype,
    device: torch.device,
    tp: TensorParallelRank = SINGLE_RANK,
) -> nn.Module:
    """This rank's part of the model (all of it for a lone rank), filled from the checkpoint."""
    with torch.device("meta"):
        model = model_class(config)(config, tp)
    model = model.to(dtype=dtype)
    if hasattr(model, "keep_fp32_"):
        model.keep_fp32_()  # parameters whose precision decides behaviour (MoE routing biases)
    model = model.to_empty(device=device)
    model.tie_weights()
    load_weights(model, model_dir)
    return model.eval()


def load_weights(model: nn.Module, model_dir: Path) -> None:
    """Copy every checkpoint tensor (or the slice of it this rank holds) into the parameter of the
    same name, casting to its dtype."""
    params = dict(model.named_parameters())  # tied parameters appear once, under their owner
    slices = checkpoint_slices(model)
    # Tensors that fill rows of a merged parameter (q/k/v, gate/up), each read as its own part.
    stacked = stacked_checkpoint_parts(model)
    merged = {param for param, _, _ in stacked.values()}
    aliases: dict[str, str] = (
        model.tied_parameter_aliases() if hasattr(model, "tied_parameter_aliases") else {}
    )
    # Tensors the model leaves out on purpose (another rank's experts, extra prediction heads).
    skip = getattr(model, "skip_checkpoint_tensor", lambda name: False)
    loaded: set[str] = set()
    unexpected: list[str] = []
    deferred: dict[str, Path] = {}
    for path in checkpoint_files(model_dir):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open handles are not iterable
                if skip(name):
                    continue
                if name in aliases:
                    # A tied copy: used only if the owner's own name is absent.
                    deferred[aliases[name]] = path
                elif name in params:
                    _copy(params[name], _read(f, name, slices.get(name)), name)
                    loaded.add(name)
                elif name in stacked:
                    param, offset, part = stacked[name]
                    tensor = _read(f, name, part if part.is_part else None)
                    _copy(params[param].narrow(0, offset, part.stop - part.start), tensor, name)
                    loaded.add(name)
                elif not name.endswith(_IGNORED_SUFFIXES):
                    unexpected.append(name)
    for owner, path in deferred.items():
        if owner not in loaded:
            alias = next(a for a, o in aliases.items() if o == owner)
            with safe_open(str(path), framework="pt", device="cpu") as f:
                _copy(params[owner], _read(f, alias, slices.get(owner)), alias)
            loaded.add(owner)
    missing = sorted((set(params) - merged - loaded) | (set(stacked) - loaded))
    if missing or unexpected:
        raise CheckpointError(
            f"checkpoint in {model_dir} does not match the model: "
            f"missing {_summary(missing)}, unexpected {_summary(sorted(unexpected))}"
        )


def _read(handle: object, name: str, part: TensorSlice | None) -> torch.Tensor:
    if part is None:
        return handle.get_tensor(name)  # type: ignore[attr-defined]
    try:
        return part.read(name, handle.get_slice(name))  # type: ignore[attr-defined]
    except ValueError as error:
        raise CheckpointError(str(error)) from None


def _copy(param: torch.Tensor, tensor: torch.Tensor, name: str) -> None:
    if tuple(param.shape) != tuple(tensor.shape):
        raise CheckpointError(
            f"{name}: checkpoint shape {tuple(tensor.shape)} != model shape {tuple(param.shape)}"
        )
    with torch.no_grad():
        param.copy_(tensor)


def _summary(names: list[str], limit: int = 8) -> str:
    if not names:
        return "none"
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return f"{len(names)} ({', '.join(names[:limit])}{more})"


def checkpoint_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's tensors under the checkpoint's names: merged q/k/v and gate/up as their parts
    (what ``load_weights`` reads back into the same model)."""
    state = model.state_dict()
    stacked = stacked_checkpoint_parts(model)
    for name, (param, offset, part) in stacked.items():
        state[name] = state[param].narrow(0, offset, part.stop - part.start)
    for param in {param for param, _, _ in stacked.values()}:
        del state[param]
    return state
