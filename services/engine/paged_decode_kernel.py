"""The CPU decode-attention kernel that reads the paged KV cache in place (``csrc/``).

The reference path (``attention._attend_group``) gathers each request's blocks into a dense
copy and runs SDPA over it; at long contexts that copy was 40% of a decode step. The kernel is
built and loaded by ``cpu_kernels``; where it cannot be built, the engine decodes through the
reference path.

Where it is built with AVX512-BF16's dot products, a bf16 prompt chunk also attends faster
through it than through SDPA (``prefill_in_place_is_faster``), so every token takes it. So does
an fp32 one on an AVX2 build, whose prompt tiles take register tiles, where the fp32 prompt
kernel (faster still) has no tile for the model's heads: Gemma 3's head_dim of 256 and its
sliding-window layers, which the kernel reads by their window (Gemma 3 270M's cold TTFT, Zen 3,
fp32: 0.88 / 0.72 / 0.56x of SDPA's at 1,800 / 3,800 / 7,500 tokens; ``bench.prompt_kernel_bench
--model gemma3-270m``).
"""

from __future__ import annotations

from types import ModuleType

import torch

from cachet.engine.cpu_kernels import load_cpu_kernel


def load_paged_decode_kernel() -> ModuleType | None:
    """The built kernel, or None where it cannot be built (logged once)."""
    return load_cpu_kernel("paged_decode_attention")


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    window: int = 0,
) -> torch.Tensor:
    """q: [batch, heads, head_dim]; caches: [num_blocks, block_size, kv_heads, head_dim];
    block_table: [batch, blocks] int64; seq_lens: [batch] int64 keys per request (its cached
    tokens and this step's one). Query head h reads KV head h // (heads / kv_heads).
    ``window`` > 0: each row attends its last ``window`` keys only (a sliding-window layer)."""
    kernel = load_paged_decode_kernel()
    if kernel is None:
        raise RuntimeError("the paged decode kernel is not built; see the engine's start-up log")
    return kernel.paged_decode_attention(q, k_cache, v_cache, block_table, seq_lens, scale, window)


def prefill_in_place_is_faster(dtype: torch.dtype, head_dim: int) -> bool:
    """Whether prompt tokens of this cache attend faster through the kernel than through SDPA:
    a bf16 cache, on a build with AVX512-BF16 dot products for this head_dim; an fp32 one, on a
    build with register tiles for it (the runner prefers the fp32 prompt kernel where that fits)."""
    kernel = load_paged_decode_kernel()
    if kernel is None:
        return False
    if dtype == torch.bfloat16:
        return bool(kernel.bf16_dot_products(head_dim))
    return dtype == torch.float32 and bool(kernel.fp32_prompt_tiles(head_dim))
