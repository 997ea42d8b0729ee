"""The panel linear kernel (csrc/panel_linear.cpp): fp32 products of bf16 weights, for CPUs whose
oneDNN has no bf16 kernels, and of fp32 weights, for AVX2 and AVX-512 hosts; a row's bits whatever
the batch."""

from __future__ import annotations

import os
import shutil

import pytest
import torch
import torch.nn.functional as F

from cachet.engine.cpu_features import cpu_flags
from cachet.engine.cpu_kernels import load_cpu_kernel
from cachet.engine.packed_linear import (
    HEAD_SMALL_BATCH_ROWS,
    SMALL_BATCH_ROWS,
    TILE_UNIT_ROWS,
    invariant_rows,
    packs_linear_weights,
    tile_unit_products,
)
from cachet.engine.tensor_parallel import ColumnParallelLinear

pytestmark = pytest.mark.skipif(
    shutil.which(os.environ.get("CXX", "c++")) is None, reason="no C++ compiler to build the kernel with"
)


@pytest.fixture(scope="module")
def kernel():
    built = load_cpu_kernel("panel_linear")
    assert built is not None, "see the engine's warning above for the compiler's message"
    return built


# Rows: one decode, the two-row path, every remainder of the six-row tile; features: an odd
# count runs the two-feature loop's tail.
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 6, 7, 13, 40])
@pytest.mark.parametrize(("in_features", "out_features"), [(64, 48), (37, 16), (96, 320)])
def test_products_are_fp32_sums_of_the_bf16_weights(
    kernel, rows: int, in_features: int, out_features: int
) -> None:
    generator = torch.Generator().manual_seed(rows * in_features)
    weight = torch.randn(out_features, in_features, generator=generator).bfloat16()
    bias = torch.randn(out_features, generator=generator)
    x = torch.randn(rows, in_features, generator=generator)
    packed = kernel.pack_weight(weight)
    assert packed.shape == (out_features // 16, in_features, 16)
    expected = F.linear(x, weight.float(), bias)
    torch.testing.assert_close(kernel.linear(x, packed, bias), expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(kernel.linear(x, packed, None), expected - bias, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows", [1, 2, 5, 6, 7, 13, 40])
@pytest.mark.parametrize(("in_features", "out_features"), [(64, 48), (64, 16), (576, 1536)])
def test_bf16_activations_sum_in_fp32(kernel, rows: int, in_features: int, out_features: int) -> None:
    """bf16 x bf16 products are exact in fp32: only the order of the fp32 sums may differ from
    torch's (an odd number of panels ends on a tile of one)."""
    generator = torch.Generator().manual_seed(rows + in_features)
    weight = torch.randn(out_features, in_features, generator=generator).bfloat16()
    bias = torch.randn(out_features, generator=generator)
    x = torch.randn(rows, in_features, generator=generator).bfloat16()
    got = kernel.linear(x.unsqueeze(0), kernel.pack_weight(weight), bias).squeeze(0)
    expected = F.linear(x.float(), weight.float(), bias)
    torch.testing.assert_close(got.float(), expected.bfloat16().float(), rtol=1e-2, atol=1e-2)
    exact = kernel.linear(x.float(), kernel.pack_weight(weight), bias)
    torch.testing.assert_close(exact, expected, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("rows", [1, 4, 13])
@pytest.mark.parametrize("with_bias", [False, True])
def test_bf16_results_are_the_fp32_sums_rounded_once(kernel, rows: int, with_bias: bool) -> None:
    """Small integers make every fp32 sum exact in any order, so each bf16 result must be that sum
    (its bias added in fp32) rounded once, to nearest with ties to even, as torch rounds: results
    past 256 need rounding, and some land on ties."""
    generator = torch.Generator().manual_seed(rows)
    weight = torch.randint(-8, 9, (96, 64), generator=generator).bfloat16()
    x = torch.randint(-8, 9, (rows, 64), generator=generator).bfloat16()
    bias = (torch.randint(-300, 300, (96,), generator=generator) + 0.5).bfloat16() if with_bias else None
    got = kernel.linear(x, kernel.pack_weight(weight), bias)
    exact = F.linear(x.float(), weight.float(), None if bias is None else bias.float())
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, exact.bfloat16())


def test_bf16_activations_and_leading_dimensions_keep_their_shape_and_dtype(kernel) -> None:
    weight = torch.randn(32, 24).bfloat16()
    x = torch.randn(2, 3, 24).bfloat16()
    got = kernel.linear(x, kernel.pack_weight(weight), None)
    assert got.shape == (2, 3, 32) and got.dtype == torch.bfloat16
    torch.testing.assert_close(got, F.linear(x.float(), weight.float()).bfloat16())


def test_bad_weights_are_refused(kernel) -> None:
    with pytest.raises(RuntimeError, match="multiple of 16"):
        kernel.pack_weight(torch.zeros(24, 8, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="bfloat16 or float32"):
        kernel.pack_weight(torch.zeros(32, 8, dtype=torch.float16))
    with pytest.raises(RuntimeError, match="pack_weight"):
        kernel.linear(torch.zeros(1, 8), torch.zeros(32, 8, dtype=torch.bfloat16), None)
    with pytest.raises(RuntimeError, match="features"):
        kernel.linear(torch.zeros(1, 9), kernel.pack_weight(torch.zeros(32, 8).bfloat16()), None)


@pytest.mark.skipif(
    bool(torch.ops.mkldnn._is_mkldnn_bf16_supported()), reason="oneDNN packs bf16 itself on this CPU"
)
def test_a_layer_packs_bf16_into_panels_where_onednn_cannot(kernel) -> None:
    layer = ColumnParallelLinear(40, 48, range(48), bias=False).bfloat16()
    odd = ColumnParallelLinear(40, 24, range(24), bias=False).bfloat16()
    assert layer.pack_() and layer.panels and layer.weight.shape == (3, 40, 16)
    assert not odd.pack_() and not odd.panels  # 24 outputs: no whole panels, stays plain


@pytest.mark.skipif(
    not torch.ops.mkldnn._is_mkldnn_bf16_supported(), reason="oneDNN has no bf16 kernels on this CPU"
)
def test_where_onednn_packs_bf16_small_batches_run_on_the_panels_beside_it(kernel) -> None:
    layer = ColumnParallelLinear(40, 48, range(48), bias=True).bfloat16()
    plain_weight = layer.weight.detach().clone()
    assert layer.pack_() and layer.weight.is_mkldnn and layer.small_batch_panels is not None
    with torch.inference_mode():
        for rows in (1, SMALL_BATCH_ROWS):
            x = torch.randn(rows, 40).bfloat16()
            expected = kernel.linear(x, kernel.pack_weight(plain_weight), layer.bias)
            assert torch.equal(layer(x), expected)
        # Past the small batches: the tile unit where there is one (AMX), up to its rows.
        if tile_unit_products():
            x = torch.randn(TILE_UNIT_ROWS, 40).bfloat16()
            assert torch.equal(layer(x), kernel.tile_unit_linear(x, layer.small_batch_panels, layer.bias))
        rows = TILE_UNIT_ROWS + 1 if tile_unit_products() else SMALL_BATCH_ROWS + 1
        x = torch.randn(rows, 40).bfloat16()
        onednn = torch.ops.mkldnn._linear_pointwise(x, layer.weight, layer.bias, "none", [], "")
        assert torch.equal(layer(x), onednn)


@pytest.mark.skipif(
    not torch.ops.mkldnn._is_mkldnn_bf16_supported(), reason="oneDNN has no bf16 kernels on this CPU"
)
def test_the_output_head_leaves_the_panels_for_onednn_at_fewer_rows_than_a_layer(kernel) -> None:
    """The head's many outputs favour oneDNN sooner: its products past HEAD_SMALL_BATCH_ROWS rows go
    there, a layer's only past SMALL_BATCH_ROWS."""
    from cachet.engine.tensor_parallel import ParallelLMHead, TensorParallelRank

    head = ParallelLMHead(40, 64, TensorParallelRank()).bfloat16()
    plain_weight = head.weight.detach().clone()
    assert head.pack_() and head.small_batch_panels is not None
    assert HEAD_SMALL_BATCH_ROWS <= SMALL_BATCH_ROWS
    with torch.inference_mode():
        x = torch.randn(HEAD_SMALL_BATCH_ROWS, 40).bfloat16()
        assert torch.equal(head.project(x), kernel.linear(x, kernel.pack_weight(plain_weight), None))
        rows = TILE_UNIT_ROWS + 1 if tile_unit_products() else HEAD_SMALL_BATCH_ROWS + 1
        x = torch.randn(rows, 40).bfloat16()
        onednn = torch.ops.mkldnn._linear_pointwise(x, head.weight, None, "none", [], "")
        assert torch.equal(head.project(x), onednn)


@pytest.mark.skipif(not tile_unit_products(), reason="no AMX tile unit on this CPU")
@pytest.mark.parametrize("rows", [1, 5, 16, 31, 32, 33, 70])
@pytest.mark.parametrize(("in_features", "out_features", "bias"), [(64, 48, True), (576, 1536, False)])
def test_tile_unit_products_on_the_panels_are_bf16_products(
    kernel, rows: int, in_features: int, out_features: int, bias: bool
) -> None:
    """oneDNN's AMX micro-kernel reads the pair panels as its right-hand side: the fp32 sums of
    the bf16 products (bias added), rounded to bf16 once, whatever the row blocks."""
    generator = torch.Generator().manual_seed(rows)
    weight = torch.randn(out_features, in_features, generator=generator).bfloat16()
    bias_values = torch.randn(out_features, generator=generator).bfloat16() if bias else None
    x = torch.randn(rows, in_features, generator=generator).bfloat16()
    out = kernel.tile_unit_linear(x, kernel.pack_weight(weight), bias_values)
    exact = F.linear(x.float(), weight.float(), None if bias_values is None else bias_values.float())
    assert out.dtype == torch.bfloat16 and out.shape == (rows, out_features)
    # Within a bf16 rounding of the exact sums (the tile unit's own fp32 order aside).
    torch.testing.assert_close(out.float(), exact, atol=1e-2, rtol=8e-3)


def test_tile_unit_products_need_a_tile_unit_and_pair_panels(kernel) -> None:
    panels = kernel.pack_weight(torch.randn(32, 64).bfloat16())
    if not kernel.tile_unit_products():
        with pytest.raises(RuntimeError, match="no tile-unit products"):
            kernel.tile_unit_linear(torch.randn(2, 64).bfloat16(), panels, None)
        return
    with pytest.raises(RuntimeError, match="pair panels"):
        kernel.tile_unit_linear(torch.randn(2, 64), panels, None)
    with pytest.raises(RuntimeError, match="features"):
        kernel.tile_unit_linear(torch.randn(2, 48).bfloat16(), panels, None)


# bf16 activations take the bf16 dot-product path where the kernel was built with one.
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("in_features", "out_features"), [(64, 48), (37, 16), (576, 1536)])
def test_a_rows_product_is_the_same_bits_alone_or_in_any_batch(
    kernel, in_features: int, out_features: int, dtype: torch.dtype
) -> None:
    """One summation order for every tile (two chains, even and odd features; or pairs of
    features in turn), so greedy decoding does not depend on what shares a step."""
    generator = torch.Generator().manual_seed(in_features)
    packed = kernel.pack_weight(torch.randn(out_features, in_features, generator=generator).bfloat16())
    x = torch.randn(40, in_features, generator=generator).to(dtype)
    alone = torch.cat([kernel.linear(x[i : i + 1], packed, None) for i in range(40)])
    # Every remainder of the 8-wide tile's 6 rows and the 12 of the 16-wide and bf16 pair tiles.
    for rows in (2, 3, 4, 5, 6, 7, 11, 12, 13, 24, 25, 40):
        assert torch.equal(kernel.linear(x[:rows], packed, None), alone[:rows]), rows


@pytest.mark.skipif(
    not torch.ops.mkldnn._is_mkldnn_bf16_supported(), reason="oneDNN has no bf16 kernels on this CPU"
)
def test_invariant_rows_run_every_product_on_one_kernel(kernel) -> None:
    """The panels' dot-product tiles, or the tile unit where there is one (AMX): every row
    count, bias included."""
    layer = ColumnParallelLinear(40, 48, range(48), bias=True).bfloat16()
    assert layer.pack_() and layer.weight.is_mkldnn and layer.small_batch_panels is not None
    one_kernel = kernel.tile_unit_linear if tile_unit_products() else kernel.linear
    with torch.inference_mode(), invariant_rows():
        for rows in (1, SMALL_BATCH_ROWS + 1, TILE_UNIT_ROWS + 1, 300):
            x = torch.randn(rows, 40).bfloat16()
            assert torch.equal(layer(x)[:1], layer(x[:1]))
            assert torch.equal(layer(x), one_kernel(x, layer.small_batch_panels, layer.bias))


@pytest.mark.skipif(not tile_unit_products(), reason="no AMX tile unit on this CPU")
@pytest.mark.parametrize(
    ("in_features", "out_features", "bias"), [(576, 960, True), (1536, 576, False), (64, 48, True)]
)
def test_a_rows_tile_unit_product_is_the_same_bits_alone_or_in_any_batch(
    kernel, in_features: int, out_features: int, bias: bool
) -> None:
    """What lets batch-invariant steps run on the tile unit: a row's sums do not depend on the
    rows beside it, in any 32-row block or its remainder."""
    generator = torch.Generator().manual_seed(out_features)
    packed = kernel.pack_weight(torch.randn(out_features, in_features, generator=generator).bfloat16())
    bias_values = torch.randn(out_features, generator=generator).bfloat16() if bias else None
    x = torch.randn(140, in_features, generator=generator).bfloat16()
    alone = torch.cat([kernel.tile_unit_linear(x[i : i + 1], packed, bias_values) for i in range(140)])
    for start, rows in ((0, 2), (0, 31), (0, 33), (5, 64), (7, 100), (0, 140)):
        got = kernel.tile_unit_linear(x[start : start + rows], packed, bias_values)
        assert torch.equal(got, alone[start : start + rows]), (start, rows)


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 6, 7, 13, 40])
@pytest.mark.parametrize(("in_features", "out_features"), [(64, 48), (37, 16), (576, 1536)])
def test_fp32_weights_give_fp32_products(kernel, rows: int, in_features: int, out_features: int) -> None:
    generator = torch.Generator().manual_seed(rows * out_features)
    weight = torch.randn(out_features, in_features, generator=generator)
    bias = torch.randn(out_features, generator=generator)
    x = torch.randn(rows, in_features, generator=generator)
    packed = kernel.pack_weight(weight)
    assert packed.shape == (out_features // 16, in_features, 16) and packed.dtype == torch.float32
    torch.testing.assert_close(
        kernel.linear(x, packed, bias), F.linear(x, weight, bias), rtol=1e-5, atol=1e-4
    )
    # A bf16 activation is widened, and the result comes back in its dtype.
    got = kernel.linear(x.bfloat16(), packed, None)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, F.linear(x.bfloat16().float(), weight).bfloat16())


@pytest.mark.parametrize(("in_features", "out_features"), [(64, 48), (37, 16), (576, 1536)])
def test_an_fp32_rows_product_is_the_same_bits_alone_or_in_any_batch(
    kernel, in_features: int, out_features: int
) -> None:
    generator = torch.Generator().manual_seed(out_features)
    packed = kernel.pack_weight(torch.randn(out_features, in_features, generator=generator))
    x = torch.randn(40, in_features, generator=generator)
    alone = torch.cat([kernel.linear(x[i : i + 1], packed, None) for i in range(40)])
    # Every remainder of the 8-wide tile's 6 rows and the 12 of the 16-wide and bf16 pair tiles.
    for rows in (2, 3, 4, 5, 6, 7, 11, 12, 13, 24, 25, 40):
        assert torch.equal(kernel.linear(x[:rows], packed, None), alone[:rows]), rows


@pytest.mark.skipif(
    not ({"avx2", "fma"} <= cpu_flags()), reason="fp32 weights go into panels on hosts with AVX2 and FMA"
)
def test_an_avx2_or_avx512_host_packs_fp32_into_panels(kernel) -> None:
    assert packs_linear_weights(torch.device("cpu"), torch.float32)
    layer = ColumnParallelLinear(40, 48, range(48), bias=True)
    odd = ColumnParallelLinear(40, 24, range(24), bias=False)
    plain = layer.weight.detach().clone()
    assert layer.pack_() and layer.panels and layer.weight.shape == (3, 40, 16)
    # 24 outputs: no whole panels, so oneDNN's layout where it has one.
    assert odd.pack_() == odd.weight.is_mkldnn and not odd.panels
    x = torch.randn(9, 40)
    with torch.inference_mode():
        torch.testing.assert_close(layer(x), F.linear(x, plain, layer.bias), rtol=1e-5, atol=1e-5)
