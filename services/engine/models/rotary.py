"""Rotary position embeddings (rotate-half layout) with the scaling variants checkpoints ask for:
linear, dynamic NTK, Llama 3 and YaRN."""

from __future__ import annotations

import math

import torch
from torch import nn

from cachet.engine.fused_token_ops import rotate_half
from cachet.engine.models.config import RopeConfig


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
    return rotate_half(x, cos, sin)
