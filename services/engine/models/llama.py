"""Llama-family decoder (Llama, SmolLM2, Qwen2 dense) over a flattened step.

The forward pass sees every token of a step in one flat axis: prefill chunks and
decode tokens of many requests concatenated, each with its own position.
Parameter names match Hugging Face checkpoints, so loading is name for name.

Attention modules never read head counts from the config: DeepSpeed AutoTP
shards q/k/v/o after construction, and the local head count is whatever the
(possibly sharded) weights hold.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from cachet.engine.attention import AttentionMetadata, PagedAttention
from cachet.engine.models.config import ModelConfig, RopeConfig


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32: bf16 sums of squares lose too much over thousands of channels.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class RotaryEmbedding(nn.Module):
    """cos/sin tables for the rotate-half RoPE layout, with the usual scaling variants.

    Frequencies are computed lazily on the positions' device instead of kept in a
    buffer: models are built on the meta device and filled from checkpoints, and
    a buffer would come out of ``to_empty`` uninitialised.
    """

    def __init__(self, head_dim: int, rope: RopeConfig, max_position_embeddings: int) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.rope = rope
        self.max_position_embeddings = max_position_embeddings
        self._inv_freq: torch.Tensor | None = None
        self.attention_scaling = _yarn_attention_factor(rope) if rope.rope_type == "yarn" else 1.0

    def forward(self, positions: torch.Tensor, seq_lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions, seq_lens: [T] -> cos, sin: [T, head_dim] in fp32."""
        if self.rope.rope_type == "dynamic":
            freqs = positions[:, None].float() * self._dynamic_inv_freq(seq_lens)
        else:
            if self._inv_freq is None or self._inv_freq.device != positions.device:
                self._inv_freq = _inv_freq(self.head_dim, self.rope).to(positions.device)
            freqs = positions[:, None].float() * self._inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos() * self.attention_scaling, emb.sin() * self.attention_scaling

    def _dynamic_inv_freq(self, seq_lens: torch.Tensor) -> torch.Tensor:
        # NTK-aware: past the trained window, raise the base with the request's own length
        # (per request, so a request's rotation never depends on its batch companions).
        dim, factor, trained = self.head_dim, self.rope.factor, self.max_position_embeddings
        length = seq_lens.float().clamp(min=trained)[:, None]
        base = self.rope.theta * ((factor * length / trained) - (factor - 1)) ** (dim / (dim - 2))
        exponents = torch.arange(0, dim, 2, dtype=torch.int64, device=seq_lens.device).float() / dim
        return 1.0 / base ** exponents[None, :]


def _inv_freq(dim: int, rope: RopeConfig) -> torch.Tensor:
    inv_freq = 1.0 / rope.theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
    if rope.rope_type == "linear":
        return inv_freq / rope.factor
    if rope.rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, rope)
    if rope.rope_type == "yarn":
        return _yarn_inv_freq(inv_freq, dim, rope)
    return inv_freq


def _llama3_inv_freq(inv_freq: torch.Tensor, rope: RopeConfig) -> torch.Tensor:
    # Long wavelengths are interpolated by `factor`, short ones kept, the band between blended.
    original = rope.original_max_position_embeddings
    assert original is not None
    low_freq_wavelen = original / rope.low_freq_factor
    high_freq_wavelen = original / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (original / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    blended = (1 - smooth) * scaled / rope.factor + smooth * scaled
    medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(medium, blended, scaled)


def _yarn_inv_freq(inv_freq: torch.Tensor, dim: int, rope: RopeConfig) -> torch.Tensor:
    original = rope.original_max_position_embeddings
    assert original is not None

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(rope.theta))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    # ramp 0 (high frequency): keep the original rotation; ramp 1: interpolate by `factor`.
    return inv_freq / rope.factor * ramp + inv_freq * (1 - ramp)


def _yarn_attention_factor(rope: RopeConfig) -> float:
    if rope.attention_factor is not None:
        return float(rope.attention_factor)

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if rope.mscale and rope.mscale_all_dim:
        return mscale(rope.factor, rope.mscale) / mscale(rope.factor, rope.mscale_all_dim)
    return mscale(rope.factor)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, H, D]; cos, sin: [T, D]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return (x * cos[:, None, :] + rotated * sin[:, None, :]).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        hidden, head_dim = config.hidden_size, config.head_dim
        self.head_dim = head_dim
        self.q_proj = nn.Linear(hidden, config.num_attention_heads * head_dim, bias=config.qkv_bias)
        self.k_proj = nn.Linear(hidden, config.num_key_value_heads * head_dim, bias=config.qkv_bias)
        self.v_proj = nn.Linear(hidden, config.num_key_value_heads * head_dim, bias=config.qkv_bias)
        self.o_proj = nn.Linear(config.num_attention_heads * head_dim, hidden, bias=config.o_proj_bias)
        self.attn = PagedAttention()

    @property
    def num_local_kv_heads(self) -> int:
        return self.k_proj.weight.shape[0] // self.head_dim

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        tokens = x.shape[0]
        # -1 heads: the local count follows the (possibly sharded) projection widths.
        q = self.q_proj(x).view(tokens, -1, self.head_dim)
        k = self.k_proj(x).view(tokens, -1, self.head_dim)
        v = self.v_proj(x).view(tokens, -1, self.head_dim)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        return self.o_proj(self.attn(q, k, v, meta).reshape(tokens, -1))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        hidden, inner, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        self.gate_proj = nn.Linear(hidden, inner, bias=bias)
        self.up_proj = nn.Linear(hidden, inner, bias=bias)
        self.down_proj = nn.Linear(inner, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config.head_dim, config.rope, config.max_position_embeddings)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        cos, sin = self.rotary_emb(positions, meta.token_seq_lens)
        cos, sin = cos.to(x.dtype), sin.to(x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin, meta)
        return self.norm(x)


class LlamaForCausalLM(nn.Module):
    """Returns logits (fp32) only for the step's sampling positions."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.tie_weights()

    def tie_weights(self) -> None:
        """Re-run after anything that replaces parameters (``to_empty``, loading)."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def tied_parameter_aliases(self) -> dict[str, str]:
        """Checkpoint names that may hold a tied parameter, mapped to the name that owns it."""
        return {"lm_head.weight": "model.embed_tokens.weight"} if self.config.tie_word_embeddings else {}

    def attention_layers(self) -> list[PagedAttention]:
        return [layer.self_attn.attn for layer in self.model.layers]

    def num_local_kv_heads(self) -> int:
        return self.model.layers[0].self_attn.num_local_kv_heads

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        hidden = self.model(input_ids, positions, meta)
        return self.lm_head(hidden[meta.sample_indices]).float()
