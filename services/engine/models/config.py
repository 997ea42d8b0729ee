"""A model's shape, parsed once from a Hugging Face ``config.json``.

Both spellings of the RoPE settings are accepted: the older top-level
``rope_theta`` + ``rope_scaling`` and the newer ``rope_parameters`` dict that
carries ``rope_theta`` itself (transformers >= 5 writes the latter).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "deepseek_v3", "kimi_k2")
# Multi-head latent attention + mixture of experts (DeepSeek-V3 architecture; Kimi K2 reuses it).
MLA_MOE_MODEL_TYPES = ("deepseek_v3", "kimi_k2")
SCORING_FUNCS = ("sigmoid", "softmax")
TOPK_METHODS = ("noaux_tc", "group_limited_greedy", "greedy")
ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn")


class UnsupportedModelError(ValueError):
    """The checkpoint asks for something this engine's model code does not implement."""


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding settings; fields a variant does not use keep their defaults."""

    rope_type: str = "default"
    theta: float = 10000.0
    factor: float = 1.0
    # The window the model was pretrained on; llama3 and yarn scale relative to it.
    original_max_position_embeddings: int | None = None
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    # yarn's cos/sin multiplier; None means "derive it from factor / mscale".
    attention_factor: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True


@dataclass(frozen=True)
class MLAConfig:
    """Multi-head latent attention: K and V are rebuilt per head from one small cached latent."""

    # None: queries come from one full projection (DeepSeek-V2-Lite); else a low-rank pair.
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    # Checkpoints converted from DeepSeek's own code keep rotary dims as interleaved pairs.
    rope_interleave: bool

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """Width of one cached token: the normalised KV latent, then the shared rotary key."""
        return self.kv_lora_rank + self.qk_rope_head_dim


@dataclass(frozen=True)
class MoEConfig:
    """DeepSeek-style routed experts plus always-on shared experts."""

    n_routed_experts: int
    n_shared_experts: int
    moe_intermediate_size: int
    num_experts_per_tok: int
    n_group: int
    topk_group: int
    scoring_func: str
    topk_method: str
    routed_scaling_factor: float
    norm_topk_prob: bool
    # Layers [0, first_k_dense_replace) keep a dense MLP; after that every moe_layer_freq-th is MoE.
    first_k_dense_replace: int
    moe_layer_freq: int

    def is_moe_layer(self, layer: int) -> bool:
        return layer >= self.first_k_dense_replace and layer % self.moe_layer_freq == 0


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope: RopeConfig
    tie_word_embeddings: bool
    qkv_bias: bool
    o_proj_bias: bool
    mlp_bias: bool
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    # Set for the DeepSeek-V3 family only; head_dim is then MLA's query/key head width.
    mla: MLAConfig | None = None
    moe: MoEConfig | None = None

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        model_type = raw.get("model_type", "")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedModelError(
                f"model_type {model_type!r} is not supported (supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
            )
        if raw.get("hidden_act", "silu") != "silu":
            raise UnsupportedModelError(f"hidden_act {raw['hidden_act']!r} is not supported (only silu)")
        if raw.get("use_sliding_window", False):
            raise UnsupportedModelError("sliding-window attention is not supported")
        num_heads = raw["num_attention_heads"]
        if model_type in MLA_MOE_MODEL_TYPES:
            return _deepseek_v3_config(raw)
        # Qwen2 always has q/k/v biases and no o_proj bias; Llama's one flag covers all four.
        qwen2 = model_type == "qwen2"
        attention_bias = bool(raw.get("attention_bias", False))
        return cls(
            model_type=model_type,
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_hidden_layers=raw["num_hidden_layers"],
            num_attention_heads=num_heads,
            num_key_value_heads=raw.get("num_key_value_heads") or num_heads,
            head_dim=raw.get("head_dim") or raw["hidden_size"] // num_heads,
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            max_position_embeddings=raw.get("max_position_embeddings", 2048),
            rope=_parse_rope(raw),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            qkv_bias=qwen2 or attention_bias,
            o_proj_bias=not qwen2 and attention_bias,
            mlp_bias=bool(raw.get("mlp_bias", False)),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=_as_id_tuple(raw.get("eos_token_id")),
        )

    @classmethod
    def from_model_dir(cls, model_dir: Path) -> ModelConfig:
        return cls.from_dict(json.loads((Path(model_dir) / "config.json").read_text()))


def _deepseek_v3_config(raw: dict[str, Any]) -> ModelConfig:
    mla = MLAConfig(
        q_lora_rank=raw.get("q_lora_rank"),
        kv_lora_rank=raw["kv_lora_rank"],
        qk_nope_head_dim=raw["qk_nope_head_dim"],
        qk_rope_head_dim=raw["qk_rope_head_dim"],
        v_head_dim=raw["v_head_dim"],
        rope_interleave=bool(raw.get("rope_interleave", True)),
    )
    moe = MoEConfig(
        n_routed_experts=raw["n_routed_experts"],
        n_shared_experts=raw.get("n_shared_experts") or 0,
        moe_intermediate_size=raw["moe_intermediate_size"],
        num_experts_per_tok=raw["num_experts_per_tok"],
        n_group=raw.get("n_group") or 1,
        topk_group=raw.get("topk_group") or 1,
        # transformers' DeepseekV3 config drops these two keys; V3 and K2 checkpoints say sigmoid/noaux_tc.
        scoring_func=raw.get("scoring_func", "sigmoid"),
        topk_method=raw.get("topk_method", "noaux_tc"),
        routed_scaling_factor=float(raw.get("routed_scaling_factor", 1.0)),
        norm_topk_prob=bool(raw.get("norm_topk_prob", False)),
        first_k_dense_replace=raw.get("first_k_dense_replace") or 0,
        moe_layer_freq=raw.get("moe_layer_freq") or 1,
    )
    if moe.scoring_func not in SCORING_FUNCS:
        raise UnsupportedModelError(f"scoring_func {moe.scoring_func!r} is not supported")
    if moe.topk_method not in TOPK_METHODS:
        raise UnsupportedModelError(f"topk_method {moe.topk_method!r} is not supported")
    if moe.n_routed_experts % moe.n_group or moe.topk_group > moe.n_group:
        raise UnsupportedModelError(
            f"{moe.n_routed_experts} experts do not split into n_group={moe.n_group} "
            f"with topk_group={moe.topk_group}"
        )
    if raw.get("attention_bias", False):
        raise UnsupportedModelError("attention_bias is not supported for MLA")
    num_heads = raw["num_attention_heads"]
    return ModelConfig(
        model_type=raw["model_type"],
        vocab_size=raw["vocab_size"],
        hidden_size=raw["hidden_size"],
        intermediate_size=raw["intermediate_size"],
        num_hidden_layers=raw["num_hidden_layers"],
        num_attention_heads=num_heads,
        # MLA has no separate KV heads: every query head gets its own K/V from the shared latent.
        num_key_value_heads=num_heads,
        head_dim=mla.qk_head_dim,
        rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
        max_position_embeddings=raw.get("max_position_embeddings", 4096),
        rope=_parse_rope(raw),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        qkv_bias=False,
        o_proj_bias=False,
        mlp_bias=False,
        bos_token_id=raw.get("bos_token_id"),
        eos_token_ids=_as_id_tuple(raw.get("eos_token_id")),
        mla=mla,
        moe=moe,
    )


def load_eos_token_ids(model_dir: Path, config: ModelConfig) -> tuple[int, ...]:
    """generation_config.json wins over config.json: chat models list their end-of-turn ids there."""
    path = Path(model_dir) / "generation_config.json"
    if path.exists():
        ids = _as_id_tuple(json.loads(path.read_text()).get("eos_token_id"))
        if ids:
            return ids
    return config.eos_token_ids


def _as_id_tuple(value: int | list[int] | None) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def _parse_rope(raw: dict[str, Any]) -> RopeConfig:
    params = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    rope_type = params.get("rope_type") or params.get("type") or "default"
    if rope_type not in ROPE_TYPES:
        raise UnsupportedModelError(
            f"rope type {rope_type!r} is not supported (supported: {', '.join(ROPE_TYPES)})"
        )
    if raw.get("partial_rotary_factor", params.get("partial_rotary_factor", 1.0)) != 1.0:
        raise UnsupportedModelError("partial rotary embeddings are not supported")
    theta = params.get("rope_theta") or raw.get("rope_theta") or 10000.0
    original = params.get("original_max_position_embeddings") or raw.get("original_max_position_embeddings")
    if rope_type in ("llama3", "yarn") and original is None:
        original = raw.get("max_position_embeddings", 2048)
    factor = params.get("factor")
    if factor is None and rope_type == "yarn":
        factor = raw.get("max_position_embeddings", 2048) / original
    return RopeConfig(
        rope_type=rope_type,
        theta=float(theta),
        factor=float(factor if factor is not None else 1.0),
        original_max_position_embeddings=original,
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        beta_fast=float(params.get("beta_fast") or 32.0),
        beta_slow=float(params.get("beta_slow") or 1.0),
        attention_factor=params.get("attention_factor"),
        mscale=params.get("mscale"),
        mscale_all_dim=params.get("mscale_all_dim"),
        truncate=bool(params.get("truncate", True)),
    )
