"""Gemma 3's text model (Gemma 3 270M / 1B and the text half of the larger ones).

Llama's decoder with Gemma's differences, each from the checkpoint's config.json:

- layers alternate sliding-window ("local") and global attention (``layer_types``; five local
  to one global in the released models), local ones rotating with their own RoPE base
  (``rope_local_base_freq``) and attending only the last ``sliding_window`` keys
  (``sliding_window``);
- queries and keys are RMS-normalised per head before rotation (``q_norm`` / ``k_norm``), and
  scores scaled by ``query_pre_attn_scalar ** -0.5`` instead of ``head_dim ** -0.5``;
- ``head_dim`` is its own setting (256 in the 270M model, whose hidden size is 640);
- a GeGLU MLP (GELU, tanh approximation);
- four norms a layer: before and after attention, before and after the MLP (the "after" ones
  normalise the branch's output before it joins the residual);
- RMSNorm scales by ``1 + weight`` (weights stored as offsets from one), in fp32;
- embeddings multiplied by ``sqrt(hidden_size)`` (rounded to the model's dtype first, as the
  reference does), the head tied to them, and logits soft-capped where
  ``final_logit_softcapping`` is set.

Local layers' attention reads a token's last ``sliding_window`` keys: the paged kernel by its
window, SDPA's groups by the step's metadata banded to it (``sliding_window``). The query scale
is folded into the queries.
"""

from __future__ import annotations

import math
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from cachet.engine.attention import AttentionMetadata
from cachet.engine.image_embeddings import ImageEmbeddings
from cachet.engine.models.config import Gemma3Config, ModelConfig
from cachet.engine.models.decoder import CausalLM, DecoderLayer, DecoderModel, RMSNorm
from cachet.engine.models.llama import MLP, Attention
from cachet.engine.models.rotary import RotaryEmbedding, apply_rotary
from cachet.engine.models.sliding_window import sliding_window_metadata
from cachet.engine.tensor_parallel import SINGLE_RANK, TensorParallelRank


class GemmaRMSNorm(RMSNorm):
    """RMSNorm whose weight is an offset from one: ``x / rms(x) * (1 + weight)``, all in fp32
    (Llama's multiplies by its weight after casting back)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__(dim, eps)
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * (1.0 + self.weight.float())).to(x.dtype)


class Gemma3Attention(Attention):
    """Llama's grouped-query attention with QK-norm, Gemma's query scale and, on local layers,
    the sliding window (the kernel's, and the banded metadata the model hands in)."""

    def __init__(
        self, config: ModelConfig, gemma3: Gemma3Config, sliding: bool, tp: TensorParallelRank
    ) -> None:
        super().__init__(config, tp)
        self.sliding = sliding
        if sliding:
            self.attn.window = gemma3.sliding_window
        self.q_norm = GemmaRMSNorm(config.head_dim, config.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(config.head_dim, config.rms_norm_eps)
        # The paged attention scales scores by head_dim ** -0.5; Gemma wants
        # query_pre_attn_scalar ** -0.5, the same where the two are equal (270M, 1B).
        self.query_scale = math.sqrt(config.head_dim / gemma3.query_pre_attn_scalar)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        tokens = x.shape[0]
        q, k, v = (part.view(tokens, -1, self.head_dim) for part in self.qkv_proj.split(x))
        q, k = apply_rotary(self.q_norm(q), cos, sin), apply_rotary(self.k_norm(k), cos, sin)
        if self.query_scale != 1.0:
            q = q * self.query_scale
        return self.o_proj(self.attn(q, k, v, meta).reshape(tokens, -1))


class GeGLU(MLP):
    """Llama's gated MLP with GELU (tanh approximation) in place of SiLU."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj.split(x)
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)


class Gemma3DecoderLayer(DecoderLayer):
    """x + norm(attention(norm(x))), then x + norm(mlp(norm(x)))."""

    def __init__(self, config: ModelConfig, self_attn: Gemma3Attention, mlp: nn.Module) -> None:
        super().__init__(config, self_attn, mlp)
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(hidden, eps)
        self.post_attention_layernorm = GemmaRMSNorm(hidden, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(hidden, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(hidden, eps)
        self.sliding = self_attn.sliding

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), cos, sin, meta))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class Gemma3Model(DecoderModel):
    """Scaled embeddings, two rotary tables (global: ``rotary_emb``, local: ``rotary_local``) and
    the step's metadata banded once for every local layer."""

    def __init__(self, config: ModelConfig, gemma3: Gemma3Config, tp: TensorParallelRank) -> None:
        layers = [
            Gemma3DecoderLayer(config, Gemma3Attention(config, gemma3, sliding, tp), GeGLU(config, tp))
            for sliding in gemma3.sliding_layers
        ]
        super().__init__(config, layers, config.head_dim, tp)
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_local = RotaryEmbedding(
            config.head_dim, gemma3.local_rope, config.max_position_embeddings
        )
        self.sliding_window = gemma3.sliding_window
        self.embed_scale = math.sqrt(config.hidden_size)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        images: ImageEmbeddings | None = None,
    ) -> torch.Tensor:
        if images is not None:
            raise ValueError("this Gemma 3 model is text only")
        x = self.embed_tokens(input_ids)
        x = x * torch.tensor(self.embed_scale, dtype=x.dtype, device=x.device)
        rotations = {
            False: tuple(t.to(x.dtype) for t in self.rotary_emb(positions, meta.token_seq_lens)),
            True: tuple(t.to(x.dtype) for t in self.rotary_local(positions, meta.token_seq_lens)),
        }
        local_meta = sliding_window_metadata(meta, positions, self.sliding_window)
        for layer in self.layers:
            sliding = cast(Gemma3DecoderLayer, layer).sliding
            cos, sin = rotations[sliding]
            x = layer(x, cos, sin, local_meta if sliding else meta)
        return self.norm(x)


class Gemma3ForCausalLM(CausalLM):
    # Its forward bands the step's metadata for the sliding layers outside attention, which a
    # step replayed between attention calls would not redo (piecewise_graphs).
    supports_piecewise_graphs = False

    def __init__(self, config: ModelConfig, tp: TensorParallelRank = SINGLE_RANK) -> None:
        if config.gemma3 is None:
            raise ValueError(f"model_type {config.model_type!r} has no Gemma 3 settings")
        super().__init__(config, Gemma3Model(config, config.gemma3, tp), tp)
        self.final_logit_softcapping = config.gemma3.final_logit_softcapping

    def num_local_kv_heads(self) -> int:
        layer = cast(DecoderLayer, self.model.layers[0])
        return cast(Gemma3Attention, layer.self_attn).num_local_kv_heads

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        images: ImageEmbeddings | None = None,
    ) -> torch.Tensor:
        logits = super().forward(input_ids, positions, meta, images)
        cap = self.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap


__all__ = [
    "GeGLU",
    "Gemma3Attention",
    "Gemma3DecoderLayer",
    "Gemma3ForCausalLM",
    "Gemma3Model",
    "GemmaRMSNorm",
]
