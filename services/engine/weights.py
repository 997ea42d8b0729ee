"""Loads Hugging Face safetensors checkpoints into the engine's own model code.

The model is built on the meta device (no memory, no random init), materialised
empty on the target device in the target dtype, and then every parameter is
filled from the checkpoint, one tensor at a time, so peak host memory stays at
one tensor rather than one model. A tensor-parallel rank's model is built with
its own slices' shapes, and the loader reads only those slices (safetensors
``get_slice``): no rank ever holds a weight it does not own. Anything the
checkpoint lacks or has in excess is an error: a silently half-loaded model
produces fluent garbage.

Released checkpoints store some weights quantized (several stored tensors make one
weight) and some models under a prefix beside a vision tower (its tensors bf16, whole on
every rank): ``checkpoint_names`` reads the stored names as the model's, and a quantized weight is dequantized whole
(``quantized_weights``) before this rank's slice of it is kept.
"""

from __future__ import annotations

import ctypes
import gc
import json
from contextlib import ExitStack
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from cachet.engine.block_q4_weights import BlockRecovery
from cachet.engine.checkpoint_names import (
    PACKED_INT,
    PACKED_INT_PARTS,
    PLAIN,
    CheckpointNames,
    StoredTensor,
    group_checkpoint_names,
)
from cachet.engine.int4_linear import Int4Linear, int4_kernel_available
from cachet.engine.models import ModelConfig, model_class
from cachet.engine.models.config import Fp8BlockQuantization, PackedIntQuantization
from cachet.engine.models.decoder import CausalLM
from cachet.engine.quantized_weights import (
    QuantizedTensorError,
    dequantize_fp8_block,
    dequantize_packed_int,
)
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
    block_weights: bool = False,
) -> CausalLM:
    """This rank's part of the model (all of it for a lone rank), filled from the checkpoint.

    ``block_weights``: keep the Q4_1 blocks found in linears' fp32 weights beside them
    (``block_q4_weights``)."""
    if isinstance(config.quantization, PackedIntQuantization) and int4_kernel_available(device, dtype):
        config = replace(config, quantization=replace(config.quantization, keep_packed=True))
    with torch.device("meta"):
        model = model_class(config)(config, tp)
    model = model.to(dtype=dtype)
    # DeepSeek-V3's own method: nn.Module's __getattr__ types any attribute it does not know as
    # Tensor | Module, hence the ignore.
    if hasattr(model, "keep_fp32_"):
        model.keep_fp32_()  # type: ignore[operator]  # parameters whose precision decides behaviour (MoE routing biases)
    model = model.to_empty(device=device)
    model.tie_weights()
    recovery = BlockRecovery(model) if block_weights else None
    load_weights(model, model_dir, recovery)
    if recovery is not None:
        recovery.attach()
    for module in model.modules():
        if isinstance(module, Int4Linear):
            module.pack_for_kernel_()
    return model.eval()


def return_freed_memory() -> None:
    """Hand the heap a load freed back to the OS. Loading frees far more than it keeps (checkpoint
    tensors, the fp32 weights packing replaces) and glibc keeps freed heap pages mapped until
    asked: 150 MB of a default-model replica's on a Zen 3 EPYC (912 -> 761 MB resident)."""
    gc.collect()
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return  # not glibc: its allocator returns memory on its own terms
    libc.malloc_trim(0)


def load_weights(model: nn.Module, model_dir: Path, recovery: BlockRecovery | None = None) -> None:
    """Fill every parameter from the checkpoint tensor of the same name (or the slice of it this
    rank holds), casting to its dtype; quantized weights are dequantized first (see
    ``checkpoint_names`` for how stored names become the model's). A checkpoint that does not
    match is refused before any weight is read. ``recovery`` sees each tensor before the cast."""
    config: ModelConfig = model.config  # type: ignore[assignment]
    params = dict(model.named_parameters())
    with _StoredTensors(model_dir) as store:
        names = group_checkpoint_names(store.names(), config)
        plan = plan_load(model, names)
        if plan.missing or plan.unexpected:
            raise CheckpointError(
                f"checkpoint in {model_dir} does not match the model: "
                f"missing {_summary(plan.missing)}, unexpected {_summary(plan.unexpected)}"
            )
        for fill in plan.fills:
            target: torch.Tensor = params[fill.param]
            if fill.rows is not None:
                target = target.narrow(0, fill.rows[0], fill.rows[1] - fill.rows[0])
            tensor = store.read(fill.stored, config, fill.part)
            if recovery is not None:
                recovery.offer(fill.param, fill.rows, tensor)
            _copy(target, tensor, fill.stored.name)


@dataclass(frozen=True)
class Fill:
    """One parameter (or its ``rows`` of a merged parameter) read from one stored tensor."""

    stored: StoredTensor
    param: str
    rows: tuple[int, int] | None
    # The part of the stored tensor this rank holds; None: all of it.
    part: TensorSlice | None


@dataclass
class LoadPlan:
    fills: list[Fill] = field(default_factory=list)
    # Parameters (or checkpoint names of merged parts) no stored tensor fills.
    missing: list[str] = field(default_factory=list)
    # Stored names nothing in the model claims.
    unexpected: list[str] = field(default_factory=list)


def plan_load(model: nn.Module, names: CheckpointNames) -> LoadPlan:
    """Which stored tensor fills which parameter: names only, so it runs on a meta-device model."""
    params = dict(model.named_parameters())  # tied parameters appear once, under their owner
    slices = checkpoint_slices(model)
    # Tensors that fill rows of a merged parameter (q/k/v, gate/up), each read as its own part.
    stacked = stacked_checkpoint_parts(model)
    merged = {param for param, _, _ in stacked.values()}
    aliases: dict[str, str] = (
        model.tied_parameter_aliases()  # type: ignore[operator]  # see load_model's ignores
        if hasattr(model, "tied_parameter_aliases")
        else {}
    )
    # Tensors the model leaves out on purpose (another rank's experts, extra prediction heads).
    skip = getattr(model, "skip_checkpoint_tensor", lambda name: False)
    plan = LoadPlan(unexpected=list(names.unexpected))
    filled: set[str] = set()
    for name, stored in names.tensors.items():
        if skip(name) or name in aliases:
            continue  # a tied copy is used below, only when the owner's own name is absent
        if stored.format == PACKED_INT and name not in params and _kept_packed(name, params):
            # The layer keeps the checkpoint's form (``Int4Linear``): each part fills its namesake.
            base = name.removesuffix("weight")
            for role, part_name in stored.parts.items():
                plan.fills.append(
                    Fill(StoredTensor(base + role, PLAIN, {"weight": part_name}), base + role, None, None)
                )
                filled.add(base + role)
            continue
        if name in params:
            plan.fills.append(Fill(stored, name, None, slices.get(name)))
        elif name in stacked:
            param, offset, part = stacked[name]
            rows = (offset, offset + part.stop - part.start)
            plan.fills.append(Fill(stored, param, rows, part if part.is_part else None))
        elif not name.endswith(_IGNORED_SUFFIXES):
            plan.unexpected.extend(stored.parts.values())
            continue
        filled.add(name)
    for alias, owner in aliases.items():
        if owner not in filled and alias in names.tensors:
            plan.fills.append(Fill(names.tensors[alias], owner, None, slices.get(owner)))
            filled.add(owner)
    plan.missing = sorted((set(params) - merged - filled) | (set(stacked) - filled))
    plan.unexpected.sort()
    return plan


def _kept_packed(name: str, params: dict[str, nn.Parameter]) -> bool:
    base = name.removesuffix("weight")
    return all(base + role in params for role in PACKED_INT_PARTS)


class _StoredTensors:
    """Every safetensors file of a checkpoint open at once: a quantized weight's parts may sit in
    different shards (the index places each tensor on its own)."""

    def __init__(self, model_dir: Path) -> None:
        self._files = checkpoint_files(model_dir)
        self._stack = ExitStack()
        self._where: dict[str, Any] = {}

    def __enter__(self) -> _StoredTensors:
        with ExitStack() as opening:  # a shard that fails to open closes the ones before it
            for path in self._files:
                handle = opening.enter_context(safe_open(str(path), framework="pt", device="cpu"))
                for name in handle.keys():  # noqa: SIM118 - safe_open handles are not iterable
                    if name in self._where:
                        raise CheckpointError(f"{name} is stored twice (again in {path.name})")
                    self._where[name] = handle
            self._stack = opening.pop_all()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()

    def names(self) -> list[str]:
        return list(self._where)

    def read(self, stored: StoredTensor, config: ModelConfig, part: TensorSlice | None) -> torch.Tensor:
        if stored.format == PLAIN:
            return _read(self._where[stored.parts["weight"]], stored.parts["weight"], part)
        tensors = {role: self._where[name].get_tensor(name) for role, name in stored.parts.items()}
        try:
            if stored.format == PACKED_INT:
                assert isinstance(config.quantization, PackedIntQuantization)
                full = dequantize_packed_int(
                    stored.name,
                    tensors["weight_packed"],
                    tensors["weight_scale"],
                    tensors["weight_shape"],
                    config.quantization,
                )
            else:
                assert isinstance(config.quantization, Fp8BlockQuantization)
                full = dequantize_fp8_block(
                    stored.name, tensors["weight"], tensors["weight_scale_inv"], config.quantization
                )
        except QuantizedTensorError as error:
            raise CheckpointError(str(error)) from None
        return full if part is None else _read(_InMemory(full), stored.name, part)


class _InMemory:
    """A dequantized tensor behind the two calls ``TensorSlice.read`` makes on a safetensors slice."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self._tensor = tensor

    def get_slice(self, name: str) -> _InMemory:
        return self

    def get_shape(self) -> list[int]:
        return list(self._tensor.shape)

    def __getitem__(self, index: tuple[slice, ...]) -> torch.Tensor:
        return self._tensor[index]


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
