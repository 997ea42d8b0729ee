"""A model's shape, parsed once from a Hugging Face ``config.json``.

Both spellings of the RoPE settings are accepted: the older top-level
``rope_theta`` + ``rope_scaling`` and the newer ``rope_parameters`` dict that
carries ``rope_theta`` itself (transformers >= 5 writes the latter).

A multimodal wrapper (Kimi K2.5's ``kimi_k25``) nests the language model's config
in ``text_config`` beside a ``vision_config``: the text model is parsed from the
former, and its checkpoint tensors carry the wrapper's prefix (``language_model.``).
How the checkpoint stores its weights (plain, FP8 blocks, packed INT4) is the
``quantization_config``, parsed into ``QuantizationConfig``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "deepseek_v3", "kimi_k2", "gemma3_text")
# Wrappers whose text_config is one of the types above and whose vision_config is Kimi's MoonViT.
MULTIMODAL_MODEL_TYPES = ("kimi_k25",)
# Where a kimi_k25 checkpoint keeps each part: the language model under one prefix, the
# vision tower and its projector (to the text width) under theirs.
KIMI_K25_TEXT_PREFIX = "language_model."
KIMI_K25_VISION_PREFIXES = ("vision_tower.", "mm_projector.")
# The model's attribute that holds the tower and its projector (``kimi_vision.KimiVisionTower``):
# a stored ``vision_tower.x`` fills parameter ``vision_tower.x``, a stored ``mm_projector.x``
# parameter ``vision_tower.mm_projector.x``.
VISION_TOWER_ATTRIBUTE = "vision_tower"
# Multi-head latent attention + mixture of experts (DeepSeek-V3 architecture; Kimi K2 reuses it).
MLA_MOE_MODEL_TYPES = ("deepseek_v3", "kimi_k2")
SCORING_FUNCS = ("sigmoid", "softmax")
TOPK_METHODS = ("noaux_tc", "group_limited_greedy", "greedy")
ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn")
# Gemma 3's text model (interleaved sliding-window and global layers, QK-norm, GeGLU).
GEMMA3_MODEL_TYPES = ("gemma3_text",)
# Gemma 3's own defaults for keys an older config.json may leave out (transformers' Gemma3TextConfig).
GEMMA3_GLOBAL_ROPE_THETA = 1_000_000.0
GEMMA3_LOCAL_ROPE_THETA = 10_000.0
GEMMA3_SLIDING_WINDOW_PATTERN = 6


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
class VisionConfig:
    """Kimi K2.5's vision tower (MoonViT: native-resolution patches, 2x2 patch merging) and the
    projector into the language model's width (``kimi_vision.KimiVisionTower``)."""

    patch_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    merge_kernel_size: tuple[int, int]
    # The learned position table's grid (height, width, frames), interpolated to each image.
    pos_emb_grid: tuple[int, int, int]
    projector_type: str
    projector_hidden_act: str
    projector_ln_eps: float
    text_hidden_size: int
    # The token the chat template repeats once per merged patch of an image.
    media_placeholder_token_id: int | None
    # Checkpoint name prefixes of the tower and the projector.
    checkpoint_prefixes: tuple[str, ...]


@dataclass(frozen=True)
class PackedIntQuantization:
    """compressed-tensors ``pack-quantized``: symmetric intN weights, N-bit values offset by
    2**(N-1) and packed low bits first into int32 words along the input dimension
    (``weight_packed`` [out, in*N/32]), one scale per ``group_size`` inputs of each row
    (``weight_scale`` [out, in/group]), and the unpacked shape (``weight_shape``). Kimi K2
    Thinking and K2.5 store their routed experts so (INT4, groups of 32)."""

    num_bits: int
    # None: one scale per output row (strategy "channel").
    group_size: int | None
    # Names or "re:" patterns the producer left unquantized; informative, the loader goes by
    # which tensors each layer has.
    ignore: tuple[str, ...]
    # Set by the loader where the device multiplies by INT4 weights directly (``int4_linear``):
    # routed experts then stay packed instead of being dequantized.
    keep_packed: bool = False


@dataclass(frozen=True)
class Fp8BlockQuantization:
    """DeepSeek-V3's FP8: ``weight`` in float8 e4m3 and ``weight_scale_inv`` (fp32), one
    multiplier per ``block`` tile of the weight (128x128 in V3 and Kimi K2 Instruct)."""

    block: tuple[int, int]


QuantizationConfig = PackedIntQuantization | Fp8BlockQuantization


@dataclass(frozen=True)
class Gemma3Config:
    """What Gemma 3's text model adds to a decoder's shape (``models/gemma3.py``)."""

    # A sliding layer's query at position p attends keys p - sliding_window + 1 .. p.
    sliding_window: int
    # One per layer: True where it is a sliding-window ("local") layer, False for a global one.
    sliding_layers: tuple[bool, ...]
    # Local layers rotate with their own base (``rope_local_base_freq``); ModelConfig.rope is the
    # global layers'.
    local_rope: RopeConfig
    # Attention scores are scaled by query_pre_attn_scalar ** -0.5, not head_dim ** -0.5.
    query_pre_attn_scalar: float
    # logits = cap * tanh(logits / cap) where set.
    final_logit_softcapping: float | None


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
    quantization: QuantizationConfig | None = None
    vision: VisionConfig | None = None
    # Set for the Gemma 3 family only.
    gemma3: Gemma3Config | None = None
    # What the checkpoint puts before the text model's parameter names ("" for a text-only model).
    checkpoint_prefix: str = ""

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        if raw.get("model_type") in MULTIMODAL_MODEL_TYPES:
            return _multimodal_config(raw)
        config = cls._text_config(raw)
        quantization = _parse_quantization(raw.get("quantization_config"))
        return replace(config, quantization=quantization) if quantization else config

    @classmethod
    def _text_config(cls, raw: dict[str, Any]) -> ModelConfig:
        model_type = raw.get("model_type", "")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedModelError(
                f"model_type {model_type!r} is not supported "
                f"(supported: {', '.join(SUPPORTED_MODEL_TYPES + MULTIMODAL_MODEL_TYPES)})"
            )
        if model_type in GEMMA3_MODEL_TYPES:
            return _gemma3_config(raw)
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


def _multimodal_config(raw: dict[str, Any]) -> ModelConfig:
    """Kimi K2.5: the language model is a DeepSeek-V3-family config under ``text_config``."""
    wrapper = raw["model_type"]
    text = raw.get("text_config")
    if not isinstance(text, dict):
        raise UnsupportedModelError(f"model_type {wrapper!r} needs a text_config")
    if text.get("model_type") not in MLA_MOE_MODEL_TYPES:
        raise UnsupportedModelError(
            f"{wrapper}'s text_config has model_type {text.get('model_type')!r}; "
            f"supported: {', '.join(MLA_MOE_MODEL_TYPES)}"
        )
    # K2.5 repeats the quantization_config at both levels; either one describes the checkpoint.
    quantization = _parse_quantization(text.get("quantization_config") or raw.get("quantization_config"))
    config = _deepseek_v3_config(text)
    return replace(
        config,
        quantization=quantization,
        vision=_vision_config(raw.get("vision_config"), raw.get("media_placeholder_token_id")),
        checkpoint_prefix=KIMI_K25_TEXT_PREFIX,
        # The wrapper's ids are the ones the tokenizer and generation settings use.
        bos_token_id=raw.get("bos_token_id", config.bos_token_id),
        eos_token_ids=_as_id_tuple(raw.get("eos_token_id")) or config.eos_token_ids,
    )


def _vision_config(raw: dict[str, Any] | None, placeholder: int | None) -> VisionConfig | None:
    if raw is None:
        return None
    merge = tuple(raw.get("merge_kernel_size") or (2, 2))
    return VisionConfig(
        patch_size=raw["patch_size"],
        hidden_size=raw["vt_hidden_size"],
        intermediate_size=raw["vt_intermediate_size"],
        num_hidden_layers=raw["vt_num_hidden_layers"],
        num_attention_heads=raw["vt_num_attention_heads"],
        merge_kernel_size=(int(merge[0]), int(merge[1])),
        pos_emb_grid=(
            raw.get("init_pos_emb_height", 64),
            raw.get("init_pos_emb_width", 64),
            raw.get("init_pos_emb_time", 1),
        ),
        projector_type=raw.get("mm_projector_type", "patchmerger"),
        projector_hidden_act=raw.get("projector_hidden_act", "gelu"),
        projector_ln_eps=float(raw.get("projector_ln_eps", 1e-5)),
        text_hidden_size=raw["text_hidden_size"],
        media_placeholder_token_id=placeholder,
        checkpoint_prefixes=KIMI_K25_VISION_PREFIXES,
    )


def _parse_quantization(raw: dict[str, Any] | None) -> QuantizationConfig | None:
    """The checkpoint's storage format; anything this engine cannot dequantize is refused here,
    before a byte of weights is read."""
    if not raw:
        return None
    method = raw.get("quant_method")
    if method == "fp8":
        return _fp8_block(raw)
    if method == "compressed-tensors":
        return _compressed_tensors(raw)
    raise UnsupportedModelError(f"quantization_config quant_method {method!r} is not supported")


def _fp8_block(raw: dict[str, Any]) -> Fp8BlockQuantization:
    if raw.get("fmt", "e4m3") != "e4m3":
        raise UnsupportedModelError(f"fp8 format {raw.get('fmt')!r} is not supported (only e4m3)")
    block = raw.get("weight_block_size")
    if not block or len(block) != 2:
        raise UnsupportedModelError("fp8 checkpoints without a 2-D weight_block_size are not supported")
    # activation_scheme (dynamic) only matters to FP8 matmuls; dequantized weights run in the
    # serving dtype.
    return Fp8BlockQuantization(block=(int(block[0]), int(block[1])))


def _compressed_tensors(raw: dict[str, Any]) -> PackedIntQuantization:
    if raw.get("format") != "pack-quantized":
        raise UnsupportedModelError(
            f"compressed-tensors format {raw.get('format')!r} is not supported (only pack-quantized)"
        )
    if raw.get("quantization_status", "compressed") != "compressed":
        raise UnsupportedModelError(
            f"compressed-tensors status {raw['quantization_status']!r}: not compressed"
        )
    groups = list((raw.get("config_groups") or {}).values())
    if len(groups) != 1:
        raise UnsupportedModelError(f"{len(groups)} compressed-tensors config groups; only one is supported")
    group = groups[0]
    weights = group.get("weights") or {}
    if group.get("input_activations") or group.get("output_activations"):
        raise UnsupportedModelError("compressed-tensors activation quantization is not supported")
    problems = []
    if weights.get("type", "int") != "int":
        problems.append(f"type {weights.get('type')!r}")
    if weights.get("num_bits") not in (2, 4, 8):
        problems.append(f"num_bits {weights.get('num_bits')!r}")
    if not weights.get("symmetric", True):
        problems.append("asymmetric (zero points)")
    if weights.get("strategy", "group") not in ("group", "channel"):
        problems.append(f"strategy {weights.get('strategy')!r}")
    if weights.get("actorder"):
        problems.append(f"actorder {weights['actorder']!r}")
    if problems:
        raise UnsupportedModelError(f"compressed-tensors weights not supported: {', '.join(problems)}")
    return PackedIntQuantization(
        num_bits=int(weights["num_bits"]),
        group_size=weights.get("group_size") if weights.get("strategy", "group") == "group" else None,
        ignore=tuple(raw.get("ignore") or ()),
    )


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


def _gemma3_config(raw: dict[str, Any]) -> ModelConfig:
    """Gemma 3's text model; both spellings of its settings: transformers >= 5's ``layer_types`` and
    per-layer-type ``rope_parameters``, or the older ``sliding_window_pattern``, ``rope_theta``,
    ``rope_local_base_freq`` and ``rope_scaling`` (the global layers')."""
    activation = raw.get("hidden_activation") or raw.get("hidden_act") or "gelu_pytorch_tanh"
    if activation != "gelu_pytorch_tanh":
        raise UnsupportedModelError(
            f"hidden_activation {activation!r} is not supported (only gelu_pytorch_tanh)"
        )
    if raw.get("attn_logit_softcapping") is not None:
        raise UnsupportedModelError("attention logit softcapping (Gemma 2) is not supported")
    if raw.get("use_bidirectional_attention"):
        raise UnsupportedModelError("bidirectional attention (an embedding model) is not supported")
    if raw.get("attention_bias", False):
        raise UnsupportedModelError("attention_bias is not supported for Gemma 3")
    layers = raw["num_hidden_layers"]
    layer_types = raw.get("layer_types")
    if layer_types is None:
        pattern = raw.get("sliding_window_pattern") or raw.get("_sliding_window_pattern")
        pattern = pattern or GEMMA3_SLIDING_WINDOW_PATTERN
        layer_types = [
            "full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(layers)
        ]
    unknown = set(layer_types) - {"sliding_attention", "full_attention"}
    if unknown or len(layer_types) != layers:
        raise UnsupportedModelError(f"layer_types {layer_types!r} do not describe {layers} layers")
    params = raw.get("rope_parameters") or {}
    if "full_attention" in params or "sliding_attention" in params:
        global_params = {"rope_theta": GEMMA3_GLOBAL_ROPE_THETA, **(params.get("full_attention") or {})}
        local_params = {"rope_theta": GEMMA3_LOCAL_ROPE_THETA, **(params.get("sliding_attention") or {})}
    else:
        global_params = {**params, "rope_theta": raw.get("rope_theta") or GEMMA3_GLOBAL_ROPE_THETA}
        global_params |= raw.get("rope_scaling") or {}
        local_params = {"rope_theta": raw.get("rope_local_base_freq") or GEMMA3_LOCAL_ROPE_THETA}
    flat = {k: v for k, v in raw.items() if k not in ("rope_parameters", "rope_scaling", "rope_theta")}
    num_heads = raw["num_attention_heads"]
    head_dim = raw.get("head_dim") or raw["hidden_size"] // num_heads
    gemma3 = Gemma3Config(
        sliding_window=int(raw["sliding_window"]),
        sliding_layers=tuple(kind == "sliding_attention" for kind in layer_types),
        local_rope=_parse_rope({**flat, "rope_parameters": local_params}),
        query_pre_attn_scalar=float(raw.get("query_pre_attn_scalar") or head_dim),
        final_logit_softcapping=raw.get("final_logit_softcapping"),
    )
    return ModelConfig(
        model_type=raw["model_type"],
        vocab_size=raw["vocab_size"],
        hidden_size=raw["hidden_size"],
        intermediate_size=raw["intermediate_size"],
        num_hidden_layers=layers,
        num_attention_heads=num_heads,
        num_key_value_heads=raw.get("num_key_value_heads") or num_heads,
        head_dim=head_dim,
        rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
        max_position_embeddings=raw.get("max_position_embeddings", 131_072),
        rope=_parse_rope({**flat, "rope_parameters": global_params}),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", True)),
        qkv_bias=False,
        o_proj_bias=False,
        mlp_bias=False,
        bos_token_id=raw.get("bos_token_id"),
        eos_token_ids=_as_id_tuple(raw.get("eos_token_id")),
        gemma3=gemma3,
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
