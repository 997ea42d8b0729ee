"""The engine's own model code, chosen by ``model_type`` from a checkpoint's config.json."""

from __future__ import annotations

from typing import Protocol

from cachet.engine.models.config import ModelConfig, RopeConfig, UnsupportedModelError
from cachet.engine.models.decoder import CausalLM
from cachet.engine.models.deepseek_v3 import DeepseekV3ForCausalLM
from cachet.engine.models.gemma3 import Gemma3ForCausalLM
from cachet.engine.models.llama import LlamaForCausalLM
from cachet.engine.tensor_parallel import TensorParallelRank


class ModelFamily(Protocol):
    """A family's model class: built from a config, for one tensor-parallel rank."""

    def __call__(self, config: ModelConfig, tp: TensorParallelRank = ...) -> CausalLM: ...


# Qwen2 dense is Llama with q/k/v biases; Kimi K2 is the DeepSeek-V3 architecture.
# The config carries the differences.
MODEL_CLASSES: dict[str, ModelFamily] = {
    "llama": LlamaForCausalLM,
    "qwen2": LlamaForCausalLM,
    "deepseek_v3": DeepseekV3ForCausalLM,
    "kimi_k2": DeepseekV3ForCausalLM,
    "gemma3_text": Gemma3ForCausalLM,
}


def model_class(config: ModelConfig) -> ModelFamily:
    try:
        return MODEL_CLASSES[config.model_type]
    except KeyError:
        raise UnsupportedModelError(f"no model code for model_type {config.model_type!r}") from None


__all__ = [
    "MODEL_CLASSES",
    "DeepseekV3ForCausalLM",
    "Gemma3ForCausalLM",
    "LlamaForCausalLM",
    "ModelConfig",
    "RopeConfig",
    "UnsupportedModelError",
    "model_class",
]
