"""Multi-head latent attention (DeepSeek-V2/V3 MLA) over a paged cache of latents.

MLA caches one vector per token, shared by every head: the normalised KV latent
``c`` (``kv_lora_rank`` wide) followed by the rotated shared key ``k_rot``
(``qk_rope_head_dim``). One layer's cache is ``[num_blocks, block_size,
kv_lora_rank + qk_rope_head_dim]``, addressed by the same slot mapping and block
tables as ``PagedAttention``, so prefix caching and the scheduler see no
difference.

Attention runs in the "absorbed" form: a head's key is ``W_UK[h] c`` and its
value ``W_UV[h] c``, so ``q . k = (W_UK[h]^T q_nope) . c + q_rot . k_rot``. The
caller folds ``W_UK`` into the query (``q_latent``) and ``W_UV`` into the output,
and this module is plain multi-query attention with one KV "head" whose key is
the whole cached vector and whose value is its first ``kv_lora_rank`` channels:

    cached token:  [ c (kv_lora_rank) | k_rot (rope) ]   <- key
                   [ c (kv_lora_rank) ]                  <- value
    query head h:  [ q_latent[h]      | q_rot[h]     ]
"""

from __future__ import annotations

import torch
from torch import nn

from cachet.engine.attention import AttentionGroup, AttentionMetadata, scaled_dot_product_attention
from cachet.engine.cpu_features import cpu_has_native_bf16


class PagedLatentAttention(nn.Module):
    """Writes the step's latents into the cache, then attends every query of the step.

    ``kv_cache`` is bound by the model runner (this layer's ``[num_blocks,
    block_size, latent_dim]`` view); a plain attribute so it stays out of state dicts.
    """

    def __init__(self, kv_lora_rank: int, scale: float) -> None:
        super().__init__()
        self.kv_lora_rank = kv_lora_rank
        self.scale = scale
        self.kv_cache: torch.Tensor | None = None

    def forward(
        self, q_latent: torch.Tensor, q_rot: torch.Tensor, latent: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """q_latent: [T, H, kv_lora_rank]; q_rot: [T, H, rope]; latent: [T, kv_lora_rank + rope].

        Returns the attention-weighted latents, [T, H, kv_lora_rank] (the caller applies W_UV).
        """
        if self.kv_cache is None:
            raise RuntimeError("PagedLatentAttention has no KV cache bound; the model runner binds it")
        cache = self.kv_cache
        cache.view(-1, cache.shape[-1]).index_copy_(0, meta.slot_mapping, latent.to(cache.dtype))
        query = torch.cat((q_latent, q_rot), dim=-1)
        out = q_latent.new_empty(q_latent.shape)
        for group in meta.groups:
            out[group.token_index] = self._attend_group(query, cache, group, meta.fixed_shapes)
        return out

    def _attend_group(
        self, query: torch.Tensor, cache: torch.Tensor, group: AttentionGroup, fixed_shapes: bool
    ) -> torch.Tensor:
        batch, max_q, max_kv = group.batch_size, group.max_query_len, group.max_kv_len
        num_heads, width = query.shape[1:]
        padded = query.new_zeros(batch * max_q, num_heads, width)
        padded[group.padded_index] = query[group.token_index]
        padded = padded.view(batch, max_q, num_heads, width).transpose(1, 2)
        keys = _gather(cache, group.block_table, max_kv)  # [B, 1, max_kv, latent_dim]
        values = keys[..., : self.kv_lora_rank]
        if padded.device.type == "cpu" and padded.dtype != torch.float32 and not cpu_has_native_bf16():
            # As in PagedAttention: bf16 SDPA is emulated and slower than the casts on AVX2 CPUs.
            padded, keys, values = padded.float(), keys.float(), values.float()
        out = scaled_dot_product_attention(
            padded, keys, values, group.mask, scale=self.scale, enable_gqa=True
        )
        out = out.transpose(1, 2).reshape(batch * max_q, num_heads, self.kv_lora_rank)
        return out[group.padded_index].to(query.dtype)


def _gather(cache: torch.Tensor, block_table: torch.Tensor, max_kv: int) -> torch.Tensor:
    """[num_blocks, block_size, D] through [B, nb] -> [B, 1, max_kv, D]."""
    batch, num_blocks = block_table.shape
    block_size, width = cache.shape[1:]
    # index_select, not cache[block_table]: the same copy, 3-4x faster on a CPU.
    gathered = cache.index_select(0, block_table.flatten()).view(batch, num_blocks * block_size, width)
    return gathered[:, None, :max_kv]
