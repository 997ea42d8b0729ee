"""The CPU paged decode kernel against SDPA over a dense copy of each request's keys."""

from __future__ import annotations

import os
import shutil

import pytest
import torch
import torch.nn.functional as F

from cachet.engine.paged_decode_kernel import load_paged_decode_kernel, paged_decode_attention

# The engine falls back to the gather path where the kernel does not build, so a broken kernel
# would only show as slowness: where a compiler is, it must build.
pytestmark = pytest.mark.skipif(
    shutil.which(os.environ.get("CXX", "c++")) is None, reason="no C++ compiler to build the kernel with"
)


def test_the_kernel_builds_where_a_compiler_is() -> None:
    assert load_paged_decode_kernel() is not None, "see the engine's warning above for the compiler's message"


def scattered_cache(
    seq_lens: list[int], block_size: int, kv_heads: int, head_dim: int, dtype: torch.dtype, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A cache whose requests' blocks are shuffled across the pool, and their block table
    (padded with block 0, as the runner pads it)."""
    generator = torch.Generator().manual_seed(seed)
    needed = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(needed) + 3
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=generator).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=generator).to(dtype)
    order = torch.randperm(num_blocks, generator=generator).tolist()
    table = torch.zeros(len(seq_lens), max(needed), dtype=torch.int64)
    for row, count in enumerate(needed):
        table[row, :count] = torch.tensor(order[:count])
        order = order[count:]
    return k_cache, v_cache, table


def dense_reference(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, table: torch.Tensor, seq_lens: list[int]
) -> torch.Tensor:
    heads, kv_heads = q.shape[1], k_cache.shape[2]
    rows = []
    for row, length in enumerate(seq_lens):
        keys = k_cache[table[row]].flatten(0, 1)[:length].float()
        values = v_cache[table[row]].flatten(0, 1)[:length].float()
        out = F.scaled_dot_product_attention(
            q[row].float()[:, None, :],
            keys.transpose(0, 1).repeat_interleave(heads // kv_heads, 0),
            values.transpose(0, 1).repeat_interleave(heads // kv_heads, 0),
        )
        rows.append(out[:, 0, :])
    return torch.stack(rows)


# Lengths around the kernel's 256-key splits, one key, and several splits.
SEQ_LENS = [1, 255, 256, 257, 700, 37]


@pytest.mark.parametrize(
    ("dtype", "atol"), [(torch.float32, 1e-5), (torch.bfloat16, 1e-2), (torch.float16, 2e-3)]
)
@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim", "block_size"),
    # 20 KV heads of one query each: a decode weighs more KV heads' values in one pass than a
    # tile has queries of one KV head (the bf16 path's probabilities must hold them all).
    [(9, 3, 64, 16), (4, 4, 32, 12), (8, 1, 128, 16), (20, 20, 64, 16)],
)
def test_kernel_matches_dense_sdpa(
    dtype: torch.dtype, atol: float, heads: int, kv_heads: int, head_dim: int, block_size: int
) -> None:
    k_cache, v_cache, table = scattered_cache(SEQ_LENS, block_size, kv_heads, head_dim, dtype)
    q = torch.randn(len(SEQ_LENS), heads, head_dim, generator=torch.Generator().manual_seed(1)).to(dtype)
    lens = torch.tensor(SEQ_LENS)
    out = paged_decode_attention(q, k_cache, v_cache, table, lens, head_dim**-0.5)
    assert out.dtype == dtype and out.shape == q.shape
    expected = dense_reference(q, k_cache, v_cache, table, SEQ_LENS)
    torch.testing.assert_close(out.float(), expected, atol=atol, rtol=0)


def test_a_request_gets_the_same_bits_whatever_shares_its_batch() -> None:
    """Splits are cut by the request's own length, so its result does not depend on the batch:
    what reproducible greedy decoding needs from attention."""
    k_cache, v_cache, table = scattered_cache(SEQ_LENS, 16, 3, 64, torch.bfloat16)
    q = torch.randn(len(SEQ_LENS), 9, 64).to(torch.bfloat16)
    lens = torch.tensor(SEQ_LENS)
    together = paged_decode_attention(q, k_cache, v_cache, table, lens, 0.125)
    for row in range(len(SEQ_LENS)):
        alone = paged_decode_attention(
            q[row : row + 1], k_cache, v_cache, table[row : row + 1], lens[row : row + 1], 0.125
        )
        assert torch.equal(alone[0], together[row])


@pytest.mark.parametrize(
    ("dtype", "heads", "kv_heads", "head_dim"),
    [
        (torch.float32, 9, 3, 64),
        (torch.bfloat16, 9, 3, 64),
        # AVX512-BF16 builds: decodes of 2 and of 1 query per KV head weigh their values from
        # registers at head_dim 128 and 256, tiles through the stored layout.
        (torch.bfloat16, 8, 4, 128),
        (torch.bfloat16, 2, 2, 256),
        (torch.float32, 8, 1, 128),
        (torch.float32, 4, 4, 32),
        (torch.float32, 6, 2, 24),
    ],
)
def test_a_prompts_tokens_read_together_get_each_tokens_own_bits(
    dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int
) -> None:
    """A chunk's tokens (consecutive rows of one request, one key more each) share their key reads
    in tiles; each row still gets the bits it gets alone, as a decode, and as part of a chunk cut
    elsewhere: a token's attention is the same computed cold, from the prefix cache, or decoding.
    Chunks of 2-3 rows, of a few, and of more than one register-tiled tile of 64 rows."""
    prompt, block_size = 600, 12
    k_cache, v_cache, table = scattered_cache([prompt], block_size, kv_heads, head_dim, dtype)
    lens = torch.arange(1, prompt + 1)
    q = torch.randn(prompt, heads, head_dim, generator=torch.Generator().manual_seed(2)).to(dtype)
    rows = table.expand(prompt, -1).contiguous()
    scale = head_dim**-0.5
    whole = paged_decode_attention(q, k_cache, v_cache, rows, lens, scale)
    for start, stop in ((0, 7), (100, 102), (250, 270), (300, 303), (120, 400), (590, 600)):
        chunk = paged_decode_attention(
            q[start:stop], k_cache, v_cache, rows[start:stop], lens[start:stop], scale
        )
        assert torch.equal(chunk, whole[start:stop]), (start, stop)
    for row in (0, 255, 256, 599):
        alone = paged_decode_attention(
            q[row : row + 1], k_cache, v_cache, rows[row : row + 1], lens[row : row + 1], scale
        )
        assert torch.equal(alone[0], whole[row]), row
    expected = dense_reference(q[::37], k_cache, v_cache, rows[::37], lens[::37].tolist())
    atol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(whole[::37].float(), expected, atol=atol, rtol=0)


def test_bad_input_is_a_clear_error() -> None:
    k_cache, v_cache, table = scattered_cache([20], 16, 2, 8, torch.float32)
    q = torch.randn(1, 4, 8)
    with pytest.raises(RuntimeError, match="share a dtype"):
        paged_decode_attention(q.to(torch.bfloat16), k_cache, v_cache, table, torch.tensor([20]), 1.0)
    with pytest.raises(RuntimeError, match="past its block table"):
        paged_decode_attention(q, k_cache, v_cache, table, torch.tensor([40]), 1.0)
    with pytest.raises(RuntimeError, match="multiple of KV heads"):
        paged_decode_attention(torch.randn(1, 3, 8), k_cache, v_cache, table, torch.tensor([20]), 1.0)
    with pytest.raises(RuntimeError, match="at least one key"):
        paged_decode_attention(q, k_cache, v_cache, table, torch.tensor([0]), 1.0)


def test_a_host_with_avx512_bf16_gets_the_dot_product_path() -> None:
    """Where the CPU has AVX512-BF16, the kernel is built with its dot products for the head sizes
    it has a path for, and prompt chunks of a bf16 cache go through it (the runner asks this)."""
    from cachet.engine.cpu_kernels import instruction_set
    from cachet.engine.paged_decode_kernel import prefill_in_place_is_faster

    kernel = load_paged_decode_kernel()
    assert kernel is not None
    build = instruction_set("paged_decode_attention")
    has_dot_products = build == "avx512bf16"
    assert kernel.bf16_dot_products(64) == has_dot_products
    assert kernel.bf16_dot_products(128) == has_dot_products
    assert kernel.bf16_dot_products(256) == has_dot_products  # Gemma 3
    assert not kernel.bf16_dot_products(32)
    assert prefill_in_place_is_faster(torch.bfloat16, 64) == has_dot_products
    # fp32 prompt tiles take register tiles on any AVX2 build (the runner prefers the fp32 prompt
    # kernel where it fits).
    has_tiles = build != "base"
    assert kernel.fp32_prompt_tiles(64) == has_tiles and kernel.fp32_prompt_tiles(256) == has_tiles
    assert not kernel.fp32_prompt_tiles(24)
    assert prefill_in_place_is_faster(torch.float32, 256) == has_tiles


@pytest.mark.parametrize(
    ("dtype", "head_dim"), [(torch.float32, 64), (torch.bfloat16, 64), (torch.bfloat16, 256)]
)
def test_a_sliding_window_reads_each_rows_last_keys_with_its_own_bits(
    dtype: torch.dtype, head_dim: int
) -> None:
    """A sliding-window layer's rows (Gemma 3's local layers) attend their last ``window`` keys,
    whose start need not fall on a split; a row's bits are still its own, alone or in a chunk."""
    prompt, window = 700, 300
    heads, kv_heads = (9, 3) if head_dim == 64 else (4, 1)
    k_cache, v_cache, table = scattered_cache([prompt], 16, kv_heads, head_dim, dtype)
    lens = torch.arange(1, prompt + 1)
    q = torch.randn(prompt, heads, head_dim, generator=torch.Generator().manual_seed(3)).to(dtype)
    rows = table.expand(prompt, -1).contiguous()
    scale = head_dim**-0.5
    whole = paged_decode_attention(q, k_cache, v_cache, rows, lens, scale, window)
    atol = 1e-5 if dtype == torch.float32 else 2e-2
    for row in (0, 299, 300, 301, 511, 699):
        first = max(0, row + 1 - window)
        keys = k_cache[table[0]].flatten(0, 1)[first : row + 1].float()
        values = v_cache[table[0]].flatten(0, 1)[first : row + 1].float()
        expected = F.scaled_dot_product_attention(
            q[row].float()[:, None, :],
            keys.transpose(0, 1).repeat_interleave(heads // kv_heads, 0),
            values.transpose(0, 1).repeat_interleave(heads // kv_heads, 0),
            scale=scale,
        )[:, 0, :]
        torch.testing.assert_close(whole[row].float(), expected, atol=atol, rtol=0)
        alone = paged_decode_attention(
            q[row : row + 1], k_cache, v_cache, rows[row : row + 1], lens[row : row + 1], scale, window
        )
        assert torch.equal(alone[0], whole[row]), row
    chunk = paged_decode_attention(q[400:470], k_cache, v_cache, rows[400:470], lens[400:470], scale, window)
    assert torch.equal(chunk, whole[400:470])
