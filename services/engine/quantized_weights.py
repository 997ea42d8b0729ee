"""Dequantize-on-load: quantized checkpoint weights back to real-valued tensors.

The reference path for the formats Kimi and DeepSeek publish: the loader rebuilds
each weight in fp32 from its stored parts and casts it to the serving dtype, so the
model code never sees a quantized tensor. It costs the memory of the serving dtype
(a fused low-bit matmul would keep the packed form; this is what it must equal).

    pack-quantized (compressed-tensors, K2 Thinking / K2.5 routed experts)
        weight_packed  int32 [out, in * bits / 32]  values + 2**(bits-1), low bits first
        weight_scale   bf16  [out, ceil(in / group)]
        weight_shape   int32 [2] = (out, in)
        weight[r, c] = (value[r, c] - 2**(bits-1)) * scale[r, c // group]

    FP8 blocks (DeepSeek-V3, K2 Instruct)
        weight            float8_e4m3fn [out, in]
        weight_scale_inv  fp32 [ceil(out / bo), ceil(in / bi)]
        weight[r, c] = weight[r, c] * scale_inv[r // bo, c // bi]
"""

from __future__ import annotations

import math

import torch

from cachet.engine.models.config import Fp8BlockQuantization, PackedIntQuantization


class QuantizedTensorError(ValueError):
    """Stored parts that do not make a weight of the stated format; the message names the tensor."""


def unpack_int32(packed: torch.Tensor, num_bits: int, columns: int) -> torch.Tensor:
    """Signed N-bit values, ``[rows, columns]`` int32, from int32 words packed low bits first."""
    per_word = 32 // num_bits
    shifts = torch.arange(per_word, dtype=torch.int32) * num_bits
    # An arithmetic shift copies the sign bit down; the mask keeps only this value's bits.
    fields = (packed.to(torch.int32)[..., None] >> shifts) & ((1 << num_bits) - 1)
    return fields.reshape(packed.shape[0], -1)[:, :columns] - (1 << (num_bits - 1))


def dequantize_packed_int(
    name: str,
    packed: torch.Tensor,
    scale: torch.Tensor,
    shape: torch.Tensor,
    scheme: PackedIntQuantization,
) -> torch.Tensor:
    rows, columns = (int(v) for v in shape.tolist())
    words = math.ceil(columns * scheme.num_bits / 32)
    if packed.dtype != torch.int32 or tuple(packed.shape) != (rows, words):
        raise QuantizedTensorError(
            f"{name}: weight_packed is {packed.dtype} {tuple(packed.shape)}, "
            f"expected int32 {(rows, words)} for weight_shape {(rows, columns)}"
        )
    group = scheme.group_size or columns
    groups = math.ceil(columns / group)
    if tuple(scale.shape) != (rows, groups):
        raise QuantizedTensorError(
            f"{name}: weight_scale is {tuple(scale.shape)}, expected {(rows, groups)} "
            f"(one per {group} inputs of each row)"
        )
    values = unpack_int32(packed, scheme.num_bits, columns).float()
    return values * scale.float().repeat_interleave(group, dim=1)[:, :columns]


def dequantize_fp8_block(
    name: str, weight: torch.Tensor, scale_inv: torch.Tensor, scheme: Fp8BlockQuantization
) -> torch.Tensor:
    if weight.dtype != torch.float8_e4m3fn or weight.dim() != 2:
        raise QuantizedTensorError(f"{name}: FP8 weight is {weight.dtype} {tuple(weight.shape)}")
    rows, columns = weight.shape
    block_rows, block_columns = scheme.block
    expected = (math.ceil(rows / block_rows), math.ceil(columns / block_columns))
    if tuple(scale_inv.shape) != expected:
        raise QuantizedTensorError(
            f"{name}: weight_scale_inv is {tuple(scale_inv.shape)}, expected {expected} "
            f"for {block_rows}x{block_columns} blocks of {(rows, columns)}"
        )
    scales = scale_inv.float().repeat_interleave(block_rows, 0)[:rows].repeat_interleave(block_columns, 1)
    return weight.float() * scales[:, :columns]
