"""Model checkpoints: converting the default GGUF, tiny test models, and resolving `CACHET_MODEL`."""

from cachet.models.catalog import (
    DEFAULT_MODEL_ID,
    GEMMA3_270M_ID,
    TINY_LLAMA_ID,
    ResolvedModel,
    ensure_default_model,
    ensure_model,
    known_model_ids,
    resolve_model,
)
from cachet.models.convert_gemma3_gguf import convert_gemma3_gguf
from cachet.models.convert_gguf import convert_gguf, find_default_gguf
from cachet.models.tiny import write_tiny_model

__all__ = [
    "DEFAULT_MODEL_ID",
    "GEMMA3_270M_ID",
    "TINY_LLAMA_ID",
    "ResolvedModel",
    "convert_gemma3_gguf",
    "convert_gguf",
    "ensure_default_model",
    "ensure_model",
    "find_default_gguf",
    "known_model_ids",
    "resolve_model",
    "write_tiny_model",
]
