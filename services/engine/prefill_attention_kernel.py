"""The CPU kernel for prompt chunks' attention over the paged KV cache (``csrc/``).

Outside batch-invariant steps a prompt chunk attends as one causal query block; the reference
path (``attention._attend_group``) gathers its request's blocks into a dense copy and runs SDPA
with a mask. The kernel reads the blocks in place, flash attention's way
(``csrc/prefill_attention.cpp``): fp32 caches on an AVX-512 or AVX2 host, bf16 ones on a host
with AMX's bf16 tiles (Sapphire Rapids and later Xeons). Elsewhere (none of these, a head_dim it
has no tile for, a bf16 cache without AMX) the paged decode kernel takes prompt tokens where it
beats SDPA (bf16 caches on AVX512-BF16 hosts, fp32 ones on AVX2 builds:
``paged_decode_kernel.prefill_in_place_is_faster``), and the reference path stays elsewhere.
"""

from __future__ import annotations

import functools

import torch

from cachet.engine.cpu_kernels import load_cpu_kernel


@functools.cache
def prefill_kernel_fits(dtype: torch.dtype, head_dim: int, group: int) -> bool:
    """Whether prompt chunks of this cache take the kernel: a build with a tile for ``head_dim``
    and ``group`` query heads per KV head in this dtype (fp32 on AVX2 or AVX-512, bf16 on AMX)."""
    if dtype not in (torch.float32, torch.bfloat16):
        return False
    kernel = load_cpu_kernel("prefill_attention")
    if kernel is None:
        return False
    if dtype == torch.bfloat16:
        return bool(kernel.supported_bf16(head_dim, group))
    return bool(kernel.supported(head_dim, group))


def prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """q: [tokens, heads, head_dim], each request's ``query_lens[i]`` newest tokens in request
    order; caches: [num_blocks, block_size, kv_heads, head_dim]; block_table: [requests, blocks]
    int64; seq_lens: [requests] keys of each (cached and new). Each token attends its request's
    keys up to its own position. Query head h reads KV head h // (heads / kv_heads)."""
    kernel = load_cpu_kernel("prefill_attention")
    if kernel is None:
        raise RuntimeError("the prefill attention kernel is not built; see the engine's start-up log")
    return kernel.prefill_attention(
        q.contiguous(), k_cache, v_cache, block_table, seq_lens, query_lens, scale
    )
