"""The fp32 prompt-chunk kernel against SDPA over a dense copy of each request's keys."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from test_paged_decode_kernel import scattered_cache

from cachet.engine import cpu_kernels
from cachet.engine.attention import PagedAttention, SequenceSpan, allocate_kv_cache, build_attention_metadata
from cachet.engine.cpu_features import cpu_flags
from cachet.engine.prefill_attention_kernel import prefill_attention, prefill_kernel_fits

# Tiles in AVX2 and FMA (or AVX-512) builds only; elsewhere the engine keeps SDPA, which
# test_attention covers, and the kernel refuses every shape.
TILES = cpu_kernels.instruction_set("prefill_attention") != "base"
needs_tiles = pytest.mark.skipif(not TILES, reason="the prompt kernel's tiles are AVX2 or AVX-512")


# bf16 chunks take the kernel in AMX builds only, where the process may use the tiles (Linux
# grants their state on request; a sandbox may refuse).
_kernel = cpu_kernels.load_cpu_kernel("prefill_attention")
AMX = cpu_kernels.instruction_set("prefill_attention") == "amx" and bool(
    _kernel is not None and _kernel.supported_bf16(64, 3)
)
needs_amx = pytest.mark.skipif(not AMX, reason="the kernel's bf16 path runs on AMX tiles")


def test_the_kernel_takes_the_shapes_it_has_tiles_for() -> None:
    assert prefill_kernel_fits(torch.float32, 64, 3) == TILES
    assert prefill_kernel_fits(torch.float32, 128, 8) == TILES
    assert not prefill_kernel_fits(torch.float32, 80, 1)
    assert prefill_kernel_fits(torch.bfloat16, 64, 3) == AMX
    assert prefill_kernel_fits(torch.bfloat16, 128, 4) == AMX
    assert not prefill_kernel_fits(torch.bfloat16, 80, 1)
    assert not prefill_kernel_fits(torch.float16, 64, 3)


def causal_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    table: torch.Tensor,
    seq_lens: list[int],
    query_lens: list[int],
) -> torch.Tensor:
    heads, kv_heads = q.shape[1], k_cache.shape[2]
    rows, first = [], 0
    for row, (length, queries) in enumerate(zip(seq_lens, query_lens, strict=True)):
        keys = (
            k_cache[table[row]].flatten(0, 1)[:length].transpose(0, 1).repeat_interleave(heads // kv_heads, 0)
        )
        values = (
            v_cache[table[row]].flatten(0, 1)[:length].transpose(0, 1).repeat_interleave(heads // kv_heads, 0)
        )
        positions = torch.arange(length - queries, length)
        mask = torch.arange(length)[None, :] <= positions[:, None]
        query = q[first : first + queries].transpose(0, 1)
        rows.append(F.scaled_dot_product_attention(query, keys, values, attn_mask=mask).transpose(0, 1))
        first += queries
    return torch.cat(rows)


# (keys, of which this step's queries): a first chunk, chunks over cached prefixes that cross the
# kernel's 512-key chunks and 16-position tiles at odd places, one two-token chunk.
LAYOUT = [(37, 37), (1300, 700), (530, 19), (2, 2), (1040, 513)]


@needs_tiles
@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim", "block_size"),
    [(9, 3, 64, 16), (4, 4, 64, 12), (8, 1, 128, 16), (16, 4, 128, 16), (10, 5, 64, 16)],
)
def test_kernel_matches_causal_sdpa(heads: int, kv_heads: int, head_dim: int, block_size: int) -> None:
    seq_lens, query_lens = [k for k, _ in LAYOUT], [n for _, n in LAYOUT]
    k_cache, v_cache, table = scattered_cache(seq_lens, block_size, kv_heads, head_dim, torch.float32)
    q = torch.randn(sum(query_lens), heads, head_dim, generator=torch.Generator().manual_seed(1))
    out = prefill_attention(
        q, k_cache, v_cache, table, torch.tensor(seq_lens), torch.tensor(query_lens), head_dim**-0.5
    )
    expected = causal_reference(q, k_cache, v_cache, table, seq_lens, query_lens)
    torch.testing.assert_close(out, expected, atol=2e-6, rtol=0)


@needs_amx
@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim", "block_size"),
    [(9, 3, 64, 16), (4, 4, 64, 12), (8, 1, 128, 16), (16, 4, 128, 16), (10, 5, 64, 16)],
)
def test_bf16_chunks_on_amx_are_as_close_as_bf16_sdpa(
    heads: int, kv_heads: int, head_dim: int, block_size: int
) -> None:
    """bf16 in, bf16 out: against the exact (fp32) attention of the same bf16 inputs, the kernel
    errs no more than SDPA does in bf16 (the output's rounding dominates both)."""
    seq_lens, query_lens = [k for k, _ in LAYOUT], [n for _, n in LAYOUT]
    k_cache, v_cache, table = scattered_cache(seq_lens, block_size, kv_heads, head_dim, torch.bfloat16)
    q = torch.randn(sum(query_lens), heads, head_dim, generator=torch.Generator().manual_seed(1)).bfloat16()
    out = prefill_attention(
        q, k_cache, v_cache, table, torch.tensor(seq_lens), torch.tensor(query_lens), head_dim**-0.5
    )
    assert out.dtype == torch.bfloat16
    exact = causal_reference(q.float(), k_cache.float(), v_cache.float(), table, seq_lens, query_lens)
    sdpa = causal_reference(q, k_cache, v_cache, table, seq_lens, query_lens)
    kernel_error = (out.float() - exact).abs()
    sdpa_error = (sdpa.float() - exact).abs()
    assert kernel_error.max() <= 1.5 * sdpa_error.max()
    assert kernel_error.mean() <= 1.5 * sdpa_error.mean()


@needs_tiles
@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.bfloat16, marks=needs_amx)])
def test_scores_far_apart_stay_finite(dtype: torch.dtype) -> None:
    """Scores hundreds apart (a key that dominates a later chunk): the running maximum moves and
    the earlier sums are rescaled, never overflowing (bf16: within its rounding of the exact)."""
    seq_lens, query_lens = [1200], [64]
    k_cache, v_cache, table = scattered_cache(seq_lens, 16, 3, 64, dtype)
    k_cache[table[0, 1000 // 16], 1000 % 16] *= 40
    q = (torch.randn(64, 9, 64, generator=torch.Generator().manual_seed(2)) * 3).to(dtype)
    out = prefill_attention(
        q, k_cache, v_cache, table, torch.tensor(seq_lens), torch.tensor(query_lens), 0.125
    )
    exact = causal_reference(q.float(), k_cache.float(), v_cache.float(), table, seq_lens, query_lens)
    assert torch.isfinite(out).all()
    tolerance = {"atol": 1e-5, "rtol": 0.0} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    torch.testing.assert_close(out.float(), exact, **tolerance)


def test_bad_input_is_a_clear_error() -> None:
    k_cache, v_cache, table = scattered_cache([40], 16, 3, 64, torch.float32)
    q = torch.randn(8, 9, 64)
    # A build without tiles says so before it looks at the lengths.
    lengths_wrong = "sum to q's tokens" if TILES else "not supported by this build"
    with pytest.raises(RuntimeError, match=lengths_wrong):
        prefill_attention(q, k_cache, v_cache, table, torch.tensor([40]), torch.tensor([7]), 0.125)
    with pytest.raises(RuntimeError, match="among its keys" if TILES else "not supported by this build"):
        prefill_attention(q, k_cache, v_cache, table, torch.tensor([4]), torch.tensor([8]), 0.125)
    with pytest.raises(RuntimeError, match="of one dtype"):
        prefill_attention(q.bfloat16(), k_cache, v_cache, table, torch.tensor([40]), torch.tensor([8]), 0.125)


def attend_step(
    attn: PagedAttention, layout: list[tuple[int, int, list[int]]], *, prefill_kernel: bool
) -> torch.Tensor:
    """One step of ``layout`` (cached tokens, new tokens, blocks) through ``attn``, whose cache
    holds the cached tokens' K/V already; the same draws every call."""
    assert attn.kv_cache is not None
    kv_heads, head_dim = attn.kv_cache.shape[-2:]
    generator = torch.Generator().manual_seed(3)
    new = sum(n for _, n, _ in layout)
    dtype = attn.kv_cache.dtype  # the model's: queries come in the cache's dtype
    q = torch.randn(new, 9, head_dim, generator=generator).to(dtype)
    k, v = (torch.randn(new, kv_heads, head_dim, generator=generator).to(dtype) for _ in range(2))
    spans = [SequenceSpan(c, n, blocks, sample=True) for c, n, blocks in layout]
    meta = build_attention_metadata(
        spans, 16, torch.device("cpu"), decode_in_place=True, prefill_kernel=prefill_kernel
    )
    return attn(q, k, v, meta)


@needs_tiles
@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.bfloat16, marks=needs_amx)])
def test_a_steps_prompt_chunks_take_the_kernel_beside_its_decodes(dtype: torch.dtype) -> None:
    """Prompt chunks (a first one, one over a cached prefix) and decodes in one step: the chunks
    through the kernel give SDPA's results (bf16: within its rounding), and layers with a sliding
    window keep SDPA."""
    layout = [(0, 40, [4, 9, 1]), (600, 1, list(range(10, 48))), (300, 90, list(range(50, 75)))]
    torch.manual_seed(0)
    cache = allocate_kv_cache(1, 80, 16, 3, 64, dtype, torch.device("cpu"))[0]
    cache.normal_()
    attn = PagedAttention()
    attn.kv_cache = cache
    through_sdpa = attend_step(attn, layout, prefill_kernel=False)
    through_kernel = attend_step(attn, layout, prefill_kernel=True)
    tolerance = {"atol": 2e-6, "rtol": 0.0} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    torch.testing.assert_close(through_kernel, through_sdpa, **tolerance)

    windowed = PagedAttention(window=32)
    windowed.kv_cache = cache
    assert torch.equal(
        attend_step(windowed, layout, prefill_kernel=True),
        attend_step(windowed, layout, prefill_kernel=False),
    )


@pytest.mark.skipif("avx512f" not in cpu_flags(), reason="the host's own build is the AVX2 one")
def test_the_avx2_build_matches_causal_sdpa_too(tmp_path: Path) -> None:
    """An AVX-512 host builds the 16-lane tiles; the 8-lane ones that AVX2 hosts build are checked
    here as well, built from the same source with AVX2 flags only."""
    from torch.utils.cpp_extension import load

    avx2 = load(
        name="cachet_prefill_attention_avx2_check",
        sources=[str(Path(cpu_kernels.__file__).parent / "csrc" / "prefill_attention.cpp")],
        extra_cflags=["-O3", "-fopenmp", "-fno-math-errno", "-mavx2", "-mfma", "-mf16c"],
        extra_ldflags=["-fopenmp"],
        build_directory=str(tmp_path),
    )
    seq_lens, query_lens = [k for k, _ in LAYOUT], [n for _, n in LAYOUT]
    for heads, kv_heads, head_dim in [(9, 3, 64), (16, 4, 128)]:
        k_cache, v_cache, table = scattered_cache(seq_lens, 16, kv_heads, head_dim, torch.float32)
        q = torch.randn(sum(query_lens), heads, head_dim, generator=torch.Generator().manual_seed(1))
        out = avx2.prefill_attention(
            q, k_cache, v_cache, table, torch.tensor(seq_lens), torch.tensor(query_lens), head_dim**-0.5
        )
        expected = causal_reference(q, k_cache, v_cache, table, seq_lens, query_lens)
        torch.testing.assert_close(out, expected, atol=2e-6, rtol=0)
