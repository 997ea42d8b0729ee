"""The engine's own model code, chosen by ``model_type`` from a checkpoint's config.json."""

from __future__ import annotations

from torch import nn

from cachet.engine.models.config import ModelConfig, RopeConfig, UnsupportedModelError
from cachet.engine.models.llama import LlamaForCausalLM

# Qwen2 dense is Llama with q/k/v biases; the config carries the difference.
MODEL_CLASSES: dict[str, type[nn.Module]] = {"llama": LlamaForCausalLM, "qwen2": LlamaForCausalLM}


def model_class(config: ModelConfig) -> type[nn.Module]:
    try:
        return MODEL_CLASSES[config.model_type]
    except KeyError:
        raise UnsupportedModelError(f"no model code for model_type {config.model_type!r}") from None


__all__ = [
    "MODEL_CLASSES",
    "LlamaForCausalLM",
    "ModelConfig",
    "RopeConfig",
    "UnsupportedModelError",
    "model_class",
]
