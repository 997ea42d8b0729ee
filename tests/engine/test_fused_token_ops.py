"""The fused per-token ops (RMSNorm, SwiGLU, rotary) give their torch references' results: rotary
bit for bit, RMSNorm and silu within the rounding of their sums and exponential; a row's bits
never depend on the rows beside it; and where the kernel cannot take the operands, the reference
runs."""

from __future__ import annotations

import pytest
import torch

from cachet.engine import fused_token_ops
from cachet.engine.cpu_kernels import load_cpu_kernel
from cachet.engine.fused_token_ops import (
    reference_rms_norm,
    reference_rotate_half,
    reference_silu_and_mul,
    rms_norm,
    rotate_half,
    silu_and_mul,
)

pytestmark = pytest.mark.skipif(
    load_cpu_kernel("fused_token_ops") is None, reason="no compiler here: the kernel does not build"
)

DTYPES = [torch.float32, torch.bfloat16]
# fp32: the sum of squares' and exp's orders only. bf16: two steps at most, at the bottom of a
# binade (2 ** -6 relative): after the sum or the exponential a result rounds twice (RMSNorm's
# normalised value, then its weighing), and where the first rounding flips the second can add a
# step (the baseline build's serial sum of squares met one such row of 700).
TOLERANCE = {torch.float32: 4e-6, torch.bfloat16: 2**-6}


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    relative = (got.float() - want.float()).abs() / want.float().abs().clamp(min=1e-3)
    assert relative.max().item() <= TOLERANCE[got.dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("rows", "dim"), [(1, 576), (16, 576), (700, 576), (5, 40), (3, 7)])
def test_rms_norm_matches_the_reference(dtype: torch.dtype, rows: int, dim: int) -> None:
    generator = torch.Generator().manual_seed(rows * dim)
    x = (torch.randn(rows, dim, generator=generator) * 3).to(dtype)
    weight = (torch.rand(dim, generator=generator) + 0.5).to(dtype)
    with torch.inference_mode():
        _close(rms_norm(x, weight, 1e-5), reference_rms_norm(x, weight, 1e-5))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("rows", "width"), [(1, 1536), (16, 1536), (600, 1536), (4, 24), (2, 5)])
def test_silu_and_mul_matches_the_reference(dtype: torch.dtype, rows: int, width: int) -> None:
    generator = torch.Generator().manual_seed(rows + width)
    gate_up = (torch.randn(rows, 2 * width, generator=generator) * 4).to(dtype)
    # Far past exp's range on both sides: silu is x there, or 0.
    gate_up[0, 0], gate_up[0, 1] = 120.0, -120.0
    with torch.inference_mode():
        _close(silu_and_mul(gate_up), reference_silu_and_mul(gate_up))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("tokens", "heads", "head_dim"), [(1, 9, 64), (33, 9, 64), (600, 3, 64), (5, 2, 24)])
def test_rotary_gives_the_references_bits_on_a_strided_view(
    dtype: torch.dtype, tokens: int, heads: int, head_dim: int
) -> None:
    """q as it comes out of a merged q/k/v projection: a view whose rows are wider than its heads."""
    generator = torch.Generator().manual_seed(tokens * heads)
    merged = torch.randn(tokens, (heads + 4) * head_dim, generator=generator).to(dtype)
    q = merged[:, head_dim : (heads + 1) * head_dim].view(tokens, heads, head_dim)
    angles = torch.randn(tokens, head_dim // 2, generator=generator) * 10
    angles = torch.cat((angles, angles), dim=-1)
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    with torch.inference_mode():
        assert torch.equal(rotate_half(q, cos, sin), reference_rotate_half(q, cos, sin))


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_rows_bits_do_not_depend_on_the_rows_beside_it(dtype: torch.dtype) -> None:
    """Alone or among 2,000 rows (where the work is split across threads), a row comes out the same."""
    generator = torch.Generator().manual_seed(7)
    x = torch.randn(2000, 576, generator=generator).to(dtype)
    weight = torch.rand(576, generator=generator).to(dtype)
    gate_up = torch.randn(2000, 3072, generator=generator).to(dtype)
    with torch.inference_mode():
        normed, activated = rms_norm(x, weight, 1e-5), silu_and_mul(gate_up)
        for row in (0, 999, 1999):
            assert torch.equal(rms_norm(x[row : row + 1], weight, 1e-5), normed[row : row + 1])
            assert torch.equal(silu_and_mul(gate_up[row : row + 1]), activated[row : row + 1])


def test_operands_the_kernel_cannot_take_run_the_reference() -> None:
    x, weight = torch.randn(4, 64), torch.rand(64)
    # Mixed dtypes, or a gradient to keep: the reference's ops, whose autograd works.
    assert fused_token_ops._kernel_for(x, weight.to(torch.bfloat16)) is None
    assert fused_token_ops._kernel_for(x.to(torch.float16)) is None
    weight.requires_grad_(True)
    assert fused_token_ops._kernel_for(x, weight) is None
    rms_norm(x, weight, 1e-5).sum().backward()
    assert weight.grad is not None
    with torch.inference_mode():
        assert fused_token_ops._kernel_for(x, weight) is not None
