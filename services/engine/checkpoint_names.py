"""Which stored tensors make which of the model's tensors: the checkpoint's names, read as the model's.

A released checkpoint does not always store a parameter as one tensor of the same
name. Kimi K2.5 puts the language model under ``language_model.`` and the vision
tower beside it; a quantized layer is several stored tensors (``weight_packed`` +
``weight_scale`` + ``weight_shape``, or an FP8 ``weight`` + ``weight_scale_inv``)
that together make one ``weight``. ``group_checkpoint_names`` sorts every stored
name into exactly one of: a part of one model tensor (the vision tower's included:
its tensors are stored plain) or unexpected. It reads names only, so a test can run it over a published index
with no weights at hand, and the loader runs the same function over the real files.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from cachet.engine.models.config import (
    VISION_TOWER_ATTRIBUTE,
    Fp8BlockQuantization,
    ModelConfig,
    PackedIntQuantization,
)

PLAIN = "plain"
PACKED_INT = "pack-quantized"
FP8_BLOCK = "fp8-block"
# The stored tensors of one quantized weight, by role (the suffix that replaces ``weight``).
PACKED_INT_PARTS = ("weight_packed", "weight_scale", "weight_shape")
FP8_BLOCK_PARTS = ("weight", "weight_scale_inv")


@dataclass(frozen=True)
class StoredTensor:
    """One of the model's tensors as the checkpoint holds it.

    ``parts`` maps a role to the stored name: ``{"weight": ...}`` for a plain tensor,
    the three ``PACKED_INT_PARTS`` or the two ``FP8_BLOCK_PARTS`` for a quantized weight.
    """

    name: str
    format: str
    parts: dict[str, str]


@dataclass
class CheckpointNames:
    """Every stored name, sorted: model tensors (by the model's name) and names nothing claims."""

    tensors: dict[str, StoredTensor] = field(default_factory=dict)
    # Stored names of the vision tower and its projector (also in ``tensors``, by parameter name).
    vision: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)


def group_checkpoint_names(names: Iterable[str], config: ModelConfig) -> CheckpointNames:
    grouped = CheckpointNames()
    vision_prefixes = config.vision.checkpoint_prefixes if config.vision else ()
    parts: dict[str, dict[str, str]] = {}
    # Only the roles of the config's own format are split off: in an unquantized checkpoint a
    # ``weight_scale_inv`` is just a name no parameter has, and is reported as such.
    roles = {
        PackedIntQuantization: PACKED_INT_PARTS,
        Fp8BlockQuantization: FP8_BLOCK_PARTS,
    }.get(type(config.quantization), ())
    for stored in names:
        if stored.startswith(vision_prefixes):
            grouped.vision.append(stored)
            name = vision_parameter_name(stored)
            grouped.tensors[name] = StoredTensor(name, PLAIN, {"weight": stored})
            continue
        if not stored.startswith(config.checkpoint_prefix):
            grouped.unexpected.append(stored)
            continue
        base, role = _split_role(stored[len(config.checkpoint_prefix) :], roles)
        parts.setdefault(base, {})[role] = stored
    for base, by_role in parts.items():
        tensor = _stored_tensor(base, by_role, config)
        if tensor is None or tensor.name in grouped.tensors:
            # A part without its partners, or a weight stored both plain and quantized.
            grouped.unexpected.extend(sorted(by_role.values()))
        else:
            grouped.tensors[tensor.name] = tensor
    return grouped


def vision_parameter_name(stored: str) -> str:
    """The model's ``vision_tower`` module holds the tower and the projector stored beside it."""
    tower = VISION_TOWER_ATTRIBUTE + "."
    return stored if stored.startswith(tower) else tower + stored


def _split_role(name: str, roles: tuple[str, ...]) -> tuple[str, str]:
    """``x.weight_packed`` -> (``x``, ``weight_packed``); a plain ``x.weight`` -> (``x.weight``, ``""``)."""
    module, _, last = name.rpartition(".")
    if last in roles:
        return module, last
    return name, ""


def _stored_tensor(base: str, roles: dict[str, str], config: ModelConfig) -> StoredTensor | None:
    if set(roles) == {""}:
        return StoredTensor(base, PLAIN, {"weight": roles[""]})
    name = f"{base}.weight"
    if set(roles) == set(PACKED_INT_PARTS):
        return StoredTensor(name, PACKED_INT, dict(roles))
    if set(roles) == set(FP8_BLOCK_PARTS):
        return StoredTensor(name, FP8_BLOCK, dict(roles))
    # A plain FP8-family weight left unquantized (norms, the router, embeddings) has no scale.
    if set(roles) == {"weight"} and isinstance(config.quantization, Fp8BlockQuantization):
        return StoredTensor(name, PLAIN, dict(roles))
    return None
