"""The pre-norm decoder both model families share: embed, rotate, N x (attention + MLP), norm, head.

A family differs only in its attention and MLP modules (and which rotary width
they use), so it hands those to ``DecoderLayer`` and builds a ``DecoderModel``;
``CausalLM`` adds the head and what the loader and the runner ask of a model.

Contract with the runner: the forward pass sees every token of a step on one
flat axis (prefill chunks and decodes of many requests concatenated, each with
its own position) and returns fp32 logits only for ``meta.sample_indices``. Where a step
holds image placeholder tokens, the runner passes the vision tower's rows for them.
Parameter names match Hugging Face checkpoints, so loading is name for name.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol, cast

import torch
from torch import nn

from cachet.engine.attention import AttentionMetadata
from cachet.engine.fused_token_ops import rms_norm
from cachet.engine.image_embeddings import ImageEmbeddings
from cachet.engine.models.config import ModelConfig
from cachet.engine.models.rotary import RotaryEmbedding
from cachet.engine.tensor_parallel import ParallelLMHead, TensorParallelRank, VocabParallelEmbedding


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class SelfAttention(Protocol):
    """What the decoder and the runner use of a family's attention module."""

    # The paged attention that owns this layer's slice of the KV cache (the runner binds it).
    @property
    def attn(self) -> nn.Module: ...

    def __call__(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor: ...


class DecoderLayer(nn.Module):
    """x + attention(norm(x)), then x + mlp(norm(x)); ``self_attn`` owns its paged cache (``.attn``)."""

    def __init__(self, config: ModelConfig, self_attn: SelfAttention, mlp: nn.Module) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = self_attn
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = mlp

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class DecoderModel(nn.Module):
    def __init__(
        self, config: ModelConfig, layers: Iterable[DecoderLayer], rotary_dim: int, tp: TensorParallelRank
    ) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp)
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(rotary_dim, config.rope, config.max_position_embeddings)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        images: ImageEmbeddings | None = None,
    ) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        if images is not None:
            # An image's placeholder tokens embed to the vision tower's rows for it.
            x[images.token_index] = images.values.to(x.dtype)
        cos, sin = self.rotary_emb(positions, meta.token_seq_lens)
        cos, sin = cos.to(x.dtype), sin.to(x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin, meta)
        return self.norm(x)


class CausalLM(nn.Module):
    """A ``DecoderModel`` and its head. Returns logits (fp32) only for the step's sampling positions."""

    def __init__(self, config: ModelConfig, model: DecoderModel, tp: TensorParallelRank) -> None:
        super().__init__()
        self.config = config
        self.tp = tp
        self.model = model
        self.lm_head = ParallelLMHead(config.hidden_size, config.vocab_size, tp)
        self.tie_weights()

    def tie_weights(self) -> None:
        """Re-run after anything that replaces parameters (``to_empty``, loading)."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def num_local_kv_heads(self) -> int:
        """KV heads this rank caches, for families whose cache is per head (MLA's is one latent:
        ``kv_cache_shape_per_token`` instead)."""
        raise NotImplementedError(f"{type(self).__name__} has no per-head KV cache")

    def kv_cache_shape_per_token(self) -> tuple[int, ...] | None:
        """A family's own per-token cache layout (MLA's one latent); None: K and V per KV head."""
        return None

    def tied_parameter_aliases(self) -> dict[str, str]:
        """Checkpoint names that may hold a tied parameter, mapped to the name that owns it."""
        return {"lm_head.weight": "model.embed_tokens.weight"} if self.config.tie_word_embeddings else {}

    def attention_layers(self) -> list[nn.Module]:
        """Each layer's paged attention, for the runner to bind its slice of the KV cache."""
        return [cast(DecoderLayer, layer).self_attn.attn for layer in self.model.layers]

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        images: ImageEmbeddings | None = None,
    ) -> torch.Tensor:
        hidden = self.model(input_ids, positions, meta, images)
        return self.lm_head(hidden[meta.sample_indices]).float()
