"""A linear layer whose weight stays INT4: the fused low-bit path for packed checkpoint experts.

Dequantizing Kimi K2.5's routed experts on load costs 3.6x their stored memory in
bf16. Where the device has a kernel that multiplies by INT4 weights directly, the
experts keep their checkpoint form instead: torch's CPU kernel
(``_weight_int4pack_mm_for_cpu``) takes symmetric INT4 as ``(q - 8) * scale`` with
zero offsets, exactly compressed-tensors' ``pack-quantized`` values (stored + 8).
On one thread a 4-token product with a 2048x1024 weight took 1.3 ms against 6.4 ms
in bf16. The kernel runs bf16 activations, so the path is taken only when the model
serves in bf16 on a CPU; elsewhere the loader dequantizes (``quantized_weights``),
which stays the reference this layer is tested against.

Life of the weight: the loader fills the three checkpoint tensors as parameters of
the same names; ``pack_for_kernel_`` then reorders them once into the kernel's
layout and frees them (their names stay, empty, so the model's parameter names are
the checkpoint's).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from cachet.engine.quantized_weights import unpack_int32

# The kernel's layout tiles the input dimension by this many 16-wide tiles.
_INNER_K_TILES = 2


def int4_kernel_available(device: torch.device, dtype: torch.dtype) -> bool:
    return (
        device.type == "cpu"
        and dtype == torch.bfloat16
        and hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu")
        and hasattr(torch.ops.aten, "_convert_weight_to_int4pack_for_cpu")
    )


def int4_kernel_fits(in_features: int, out_features: int, group_size: int) -> bool:
    """The kernel's layout needs whole groups and whole tiles of the input, and rows by 8."""
    tile = 16 * _INNER_K_TILES
    return in_features % group_size == 0 and in_features % tile == 0 and out_features % 8 == 0


class Int4Linear(nn.Module):
    """``y = x @ W.T`` with ``W = (q - 8) * scale``, one scale per ``group_size`` inputs of a row."""

    def __init__(self, in_features: int, out_features: int, group_size: int) -> None:
        super().__init__()
        self.in_features, self.out_features, self.group_size = in_features, out_features, group_size
        frozen = {"requires_grad": False}
        self.weight_packed = nn.Parameter(
            torch.empty(out_features, math.ceil(in_features / 8), dtype=torch.int32), **frozen
        )
        self.weight_scale = nn.Parameter(torch.empty(out_features, in_features // group_size), **frozen)
        self.weight_shape = nn.Parameter(torch.empty(2, dtype=torch.int32), **frozen)
        self.register_buffer("kernel_weight", None)
        self.register_buffer("kernel_scales", None)

    def pack_for_kernel_(self) -> None:
        shape = tuple(int(v) for v in self.weight_shape.tolist())
        if shape != (self.out_features, self.in_features):
            raise ValueError(f"weight_shape {shape} != layer shape {(self.out_features, self.in_features)}")
        values = unpack_int32(self.weight_packed.data, 4, self.in_features) + 8
        self.kernel_weight = torch.ops.aten._convert_weight_to_int4pack_for_cpu(values, _INNER_K_TILES)
        scales = self.weight_scale.data.to(torch.bfloat16).t()
        # [groups, out, (scale, zero)]: symmetric, so every zero offset is 0.
        self.kernel_scales = torch.stack((scales, torch.zeros_like(scales)), dim=-1).contiguous()
        for param in (self.weight_packed, self.weight_scale):
            param.data = param.data.new_empty(0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int4pack_mm_for_cpu(
            x, self.kernel_weight, self.group_size, self.kernel_scales
        )

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, group_size={self.group_size}"
        )
