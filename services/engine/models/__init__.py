"""The engine's own model code, chosen by ``model_type`` from a checkpoint's config.json."""

from __future__ import annotations

from torch import nn

from cachet.engine.models.config import ModelConfig, RopeConfig, UnsupportedModelError
from cachet.engine.models.deepseek_v3 import DeepseekV3ForCausalLM
from cachet.engine.models.llama import LlamaForCausalLM

# Qwen2 dense is Llama with q/k/v biases; Kimi K2 is the DeepSeek-V3 architecture.
# The config carries the differences.
MODEL_CLASSES: dict[str, type[nn.Module]] = {
    "llama": LlamaForCausalLM,
    "qwen2": LlamaForCausalLM,
    "deepseek_v3": DeepseekV3ForCausalLM,
    "kimi_k2": DeepseekV3ForCausalLM,
}


def model_class(config: ModelConfig) -> type[nn.Module]:
    try:
        return MODEL_CLASSES[config.model_type]
    except KeyError:
        raise UnsupportedModelError(f"no model code for model_type {config.model_type!r}") from None


__all__ = [
    "MODEL_CLASSES",
    "DeepseekV3ForCausalLM",
    "LlamaForCausalLM",
    "ModelConfig",
    "RopeConfig",
    "UnsupportedModelError",
    "model_class",
]
