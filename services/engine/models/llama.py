"""Llama-family decoder (Llama, SmolLM2, Qwen2 dense): grouped-query attention and a SwiGLU MLP.

Tensor parallel: q/k/v are cut by KV-head groups (a rank's query heads are the
ones that share its KV heads), o_proj by the same input columns; the MLP's
gate/up by intermediate channels, down_proj by the same input columns. Attention
never reads head counts from the config: the local count is whatever the
(possibly split) weights hold, and the KV cache holds local KV heads only.
"""

from __future__ import annotations

from typing import cast

import torch
from torch import nn

from cachet.engine.attention import AttentionMetadata, PagedAttention
from cachet.engine.fused_token_ops import silu_and_mul
from cachet.engine.models.config import ModelConfig
from cachet.engine.models.decoder import CausalLM, DecoderLayer, DecoderModel, RMSNorm
from cachet.engine.models.rotary import RotaryEmbedding, apply_rotary
from cachet.engine.tensor_parallel import (
    SINGLE_RANK,
    MergedColumnParallelLinear,
    RowParallelLinear,
    TensorParallelRank,
)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, tp: TensorParallelRank = SINGLE_RANK) -> None:
        super().__init__()
        hidden, head_dim = config.hidden_size, config.head_dim
        kv_heads = tp.split(config.num_key_value_heads, "KV heads")
        group = config.num_attention_heads // config.num_key_value_heads
        q_rows = range(kv_heads.start * group * head_dim, kv_heads.stop * group * head_dim)
        kv_rows = range(kv_heads.start * head_dim, kv_heads.stop * head_dim)
        self.head_dim = head_dim
        full_q, full_kv = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
        parts = {"q_proj": (full_q, q_rows), "k_proj": (full_kv, kv_rows), "v_proj": (full_kv, kv_rows)}
        self.qkv_proj = MergedColumnParallelLinear(hidden, parts, bias=config.qkv_bias)
        self.o_proj = RowParallelLinear(full_q, q_rows, hidden, tp, bias=config.o_proj_bias)
        self.attn = PagedAttention()

    @property
    def num_local_kv_heads(self) -> int:
        return self.qkv_proj.output_sizes[1] // self.head_dim

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        tokens = x.shape[0]
        # -1 heads: the local count follows the (possibly split) projection widths.
        q, k, v = (part.view(tokens, -1, self.head_dim) for part in self.qkv_proj.split(x))
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        return self.o_proj(self.attn(q, k, v, meta).reshape(tokens, -1))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig, tp: TensorParallelRank = SINGLE_RANK) -> None:
        super().__init__()
        hidden, inner, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        channels = tp.split(inner, "MLP channels")
        parts = {"gate_proj": (inner, channels), "up_proj": (inner, channels)}
        self.gate_up_proj = MergedColumnParallelLinear(hidden, parts, bias=bias)
        self.down_proj = RowParallelLinear.by_units(inner, 1, hidden, tp, bias, what="MLP channels")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The merged product's output is [gate | up], as silu_and_mul reads it.
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


class LlamaForCausalLM(CausalLM):
    def __init__(self, config: ModelConfig, tp: TensorParallelRank = SINGLE_RANK) -> None:
        layers = (
            DecoderLayer(config, Attention(config, tp), MLP(config, tp))
            for _ in range(config.num_hidden_layers)
        )
        super().__init__(config, DecoderModel(config, layers, config.head_dim, tp), tp)

    def num_local_kv_heads(self) -> int:
        # Every layer's attention is this family's own (built above).
        layer = cast(DecoderLayer, self.model.layers[0])
        return cast(Attention, layer.self_attn).num_local_kv_heads


__all__ = ["MLP", "Attention", "LlamaForCausalLM", "RMSNorm", "RotaryEmbedding", "apply_rotary"]
