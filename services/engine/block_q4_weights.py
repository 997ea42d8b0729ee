"""Linear weights kept as the checkpoint's 4-bit blocks, for products of a few rows (CPU).

The default model is published as a GGUF whose projections are Q4_1: every 32 inputs of an
output share an fp16 scale ``d`` and offset ``m``, and each weight is ``d * q + m`` for a 4-bit
``q``. Conversion writes those values out in fp32 (``libs/models/convert_gguf``), exactly, and a
bf16 replica then rounds them to 16 bits: 213 MB of projections that a decode step streams
whole, where the blocks are 73 MB. ``csrc/block_q4_linear.cpp`` multiplies bf16 rows by the
blocks directly, on AVX512-BF16's dot products, and computes with the checkpoint's exact weights.

The loader finds the blocks in the fp32 values it reads, before they are cast: in each block
of 32, the smallest value is ``m`` (q = 0) and the largest ``15 d + m``; the fp16 ``d`` that
gives the largest back, and the codes ``q``, are then checked against every value of the block,
so a weight is kept as blocks only when they give back each of its values bit for bit
(``recover_q4_1``). Any other checkpoint's weights fail that check and stay as they were.

fp32 replicas (the default on AVX2-only CPUs) keep them too, on any host with AVX2 and FMA: the
kernel rebuilds each weight as ``fma(d, q, m)``, the checkpoint's fp32 value, and sums as the fp32
panels do, so its products are the panels' bits and it serves them in any step: every product
where the fp32 panels are the AVX2 build's, a few rows beside AVX-512's (``fp32_block_rows``).
They also keep a weight found as Q8_0 blocks (``d * q``, an 8-bit ``q``): the GGUF's embedding,
so the default model's tied head, 113 MB in fp32 and 30 MB as blocks, which a decode step reads
whole for its logits (one stream on a Zen 3 EPYC: a step 0.89x as long).

Where (bf16): replicas on CPUs whose kernel build has AVX512-BF16, AMX hosts among them (their
products of more rows keep the tile unit, ``packed_linear``; on an AMX Xeon one step's layer
products at 1 / 4 / 8 rows took 0.48 / 0.88 / 1.10x the bf16 panels' time). A linear with
blocks runs on them its products of up to ``BLOCK_Q4_ROWS`` rows outside batch-invariant steps,
and with ``all_steps`` (``EngineSettings.block_q4_weights``) every product of batch-invariant
steps too; its other products stay on the bf16 panels or oneDNN's bf16 weight, which the linear
keeps beside the blocks.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from cachet.engine.cpu_features import cpu_flags
from cachet.engine.cpu_kernels import instruction_set, load_cpu_kernel
from cachet.engine.packed_linear import PackableLinear

BLOCK = 32
_PANEL = 16
_LEVELS = 15
# The kernel multiplies by 128 + q, a bf16 made from q's bits alone (csrc/block_q4_linear.cpp).
_CODE_OFFSET = 128
# Q8_0's largest code: a block's largest magnitude over d.
_Q8_LEVELS = 127


@dataclass(frozen=True)
class Q4_1Blocks:  # noqa: N801 - the format's own name
    """A weight ``[out, in]`` as ``d[r, b] * codes[r, c] + m[r, b]`` with ``b = c // 32``."""

    codes: torch.Tensor  # uint8 [out, in], 0..15
    scales: torch.Tensor  # fp16 [out, in / 32]: d
    offsets: torch.Tensor  # fp16 [out, in / 32]: m

    def dequantize(self) -> torch.Tensor:
        """The weight in fp32, as the checkpoint's converter computed it (``d * q`` is exact)."""
        rows, columns = self.codes.shape
        blocks = self.codes.view(rows, columns // BLOCK, BLOCK).float()
        values = self.scales.float()[..., None] * blocks + self.offsets.float()[..., None]
        return values.view(rows, columns)


def recover_q4_1(weight: torch.Tensor) -> Q4_1Blocks | None:
    """The Q4_1 blocks whose values are exactly ``weight`` (fp32 ``[out, in]``), or None where
    any block's values are not ``d * q + m`` for fp16 ``d``, ``m`` and 4-bit ``q``."""
    if not _blockable(weight) or (weight.shape[0] > 1 and _q4_1_blocks(weight[:1]) is None):
        return None
    return _q4_1_blocks(weight)


def _q4_1_blocks(weight: torch.Tensor) -> Q4_1Blocks | None:
    rows, columns = weight.shape
    blocks = weight.reshape(rows, columns // BLOCK, BLOCK)
    low, high = blocks.amin(dim=-1), blocks.amax(dim=-1)
    offsets = low.to(torch.float16)
    if not torch.equal(offsets.float(), low):
        return None
    nearest = ((high - low) / _LEVELS).to(torch.float16)
    # The stored d rounds to within an fp16 step of (max - min) / 15; the candidate that gives
    # every value back is the one. Bit patterns of positive fp16 values order as the values do.
    bits = nearest.view(torch.int16)
    codes = torch.zeros_like(blocks, dtype=torch.uint8)
    found = torch.zeros_like(low, dtype=torch.bool)
    scales = torch.zeros_like(nearest)
    for step in (0, 1, -1):
        candidate = (bits + step).clamp(min=0).view(torch.float16)
        scale = candidate.float()[..., None]
        q = torch.where(scale > 0, torch.round((blocks - low[..., None]) / scale), torch.zeros_like(blocks))
        q = q.clamp(0, _LEVELS)
        exact = (scale * q + offsets.float()[..., None] == blocks).all(dim=-1) & ~found
        codes = torch.where(exact[..., None], q.to(torch.uint8), codes)
        scales = torch.where(exact, candidate, scales)
        found |= exact
    if not bool(found.all()):
        return None
    return Q4_1Blocks(codes.view(rows, columns), scales, offsets)


@dataclass(frozen=True)
class Q8_0Blocks:  # noqa: N801 - the format's own name
    """A weight ``[out, in]`` as ``d[r, b] * codes[r, c]`` with ``b = c // 32`` (GGUF's Q8_0: the
    default model's embedding, so its tied head)."""

    codes: torch.Tensor  # int8 [out, in], -127..127
    scales: torch.Tensor  # fp16 [out, in / 32]: d

    def dequantize(self) -> torch.Tensor:
        """The weight in fp32, as the checkpoint's converter computed it (``d * q`` is exact)."""
        rows, columns = self.codes.shape
        blocks = self.codes.view(rows, columns // BLOCK, BLOCK).float()
        return (self.scales.float()[..., None] * blocks).view(rows, columns)


def recover_q8_0(weight: torch.Tensor) -> Q8_0Blocks | None:
    """The Q8_0 blocks whose values are exactly ``weight`` (fp32 ``[out, in]``), or None where any
    block's values are not ``d * q`` for an fp16 ``d`` and an 8-bit ``q``. The quantizer sets ``d``
    to a block's largest magnitude over 127, so that value's code is +-127 and ``d`` is found from
    it (the fp16 it was stored as, checked against every value)."""
    if not _blockable(weight) or (weight.shape[0] > 1 and _q8_0_blocks(weight[:1]) is None):
        return None
    return _q8_0_blocks(weight)


def _q8_0_blocks(weight: torch.Tensor) -> Q8_0Blocks | None:
    rows, columns = weight.shape
    blocks = weight.reshape(rows, columns // BLOCK, BLOCK)
    scales = (blocks.abs().amax(dim=-1) / _Q8_LEVELS).to(torch.float16)
    scale = scales.float()[..., None]
    codes = torch.where(scale > 0, torch.round(blocks / scale), torch.zeros_like(blocks))
    if not bool((codes.abs() <= _Q8_LEVELS).all()) or not torch.equal(scale * codes, blocks):
        return None
    return Q8_0Blocks(codes.to(torch.int8).view(rows, columns), scales)


def _blockable(weight: torch.Tensor) -> bool:
    """An fp32 ``[out, in]`` weight of whole blocks. The recoveries then try its first row alone:
    a weight that is no such blocks fails there, without a pass over all of it (a 64 MB fp32
    weight's full Q8_0 pass took 330 ms on two Zen 3 cores; a checkpoint not converted from
    GGUF would pay it for every linear at load)."""
    return (
        weight.dtype == torch.float32
        and weight.dim() == 2
        and not weight.shape[1] % BLOCK
        and weight.numel() > 0
    )


def concatenate(parts: list[Q4_1Blocks] | list[Q8_0Blocks]) -> Q4_1Blocks | Q8_0Blocks:
    """Blocks of row ranges, all of one format, stacked in order (a merged projection's parts)."""
    codes, scales = torch.cat([part.codes for part in parts]), torch.cat([part.scales for part in parts])
    if all(isinstance(part, Q4_1Blocks) for part in parts):
        return Q4_1Blocks(
            codes, scales, torch.cat([part.offsets for part in parts if isinstance(part, Q4_1Blocks)])
        )
    return Q8_0Blocks(codes, scales)


def _stacked_if_one_format(
    found: Sequence[Q4_1Blocks | Q8_0Blocks | None],
) -> Q4_1Blocks | Q8_0Blocks | None:
    """A linear's recovered parts stacked in order, or None where they mix formats (one
    kernel reads one format; Q8_0 parts come only for fp32 linears: ``offer``)."""
    q4 = [part for part in found if isinstance(part, Q4_1Blocks)]
    if len(q4) == len(found):
        return concatenate(q4)
    q8 = [part for part in found if isinstance(part, Q8_0Blocks)]
    return concatenate(q8) if len(q8) == len(found) else None


def pack_blocks(blocks: Q4_1Blocks) -> torch.Tensor:
    """The kernel's layout: uint8 ``[out / 16, in / 32, 352]``, pairs of panels interleaved by
    block (``csrc/block_q4_linear.cpp``): codes, d (fp16) and m - 128 d (fp32) a block."""
    panels, per_row = _panels_and_blocks(blocks)
    # codes[panel, output j, block, word c, nibble n, parity p] for feature 8c + 2n + p; the
    # 16-bit lane 2j + p of word c holds nibble n at bits 4n.
    nibbles = blocks.codes.view(panels, _PANEL, per_row, BLOCK // 8, 4, 2).to(torch.int32)
    nibbles = nibbles.permute(0, 2, 3, 1, 5, 4)  # [panel, block, word, j, p, n]
    lanes = (nibbles << torch.tensor([0, 4, 8, 12], dtype=torch.int32)).sum(dim=-1)
    codes = lanes.to(torch.int16).reshape(panels, per_row, -1).view(torch.uint8)
    shifted_offsets = blocks.offsets.float() - _CODE_OFFSET * blocks.scales.float()
    packed = torch.cat((codes, _by_block(blocks.scales), _by_block(shifted_offsets)), dim=-1)
    # Pairs of panels interleaved block by block: the kernel's tile of two streams one run.
    whole = panels // 2 * 2
    pairs = packed[:whole].view(whole // 2, 2, per_row, -1).transpose(1, 2).reshape(whole, per_row, -1)
    return torch.cat((pairs, packed[whole:])).contiguous()


def pack_fp32_blocks(blocks: Q4_1Blocks) -> torch.Tensor:
    """The kernel's layout for fp32 rows: uint8 ``[out / 16, in / 32, 320]``, a feature's 16 codes
    in 8 bytes (output b low, b + 8 high), then d and m (fp16) a block (``fp32_linear``)."""
    panels, per_row = _panels_and_blocks(blocks)
    # codes[panel, half h, output b, block, feature f] for output 8h + b.
    nibbles = blocks.codes.view(panels, 2, _PANEL // 2, per_row, BLOCK)
    nibbles = nibbles.permute(0, 3, 4, 2, 1)  # [panel, block, f, b, h]
    codes = (nibbles[..., 0] | (nibbles[..., 1] << 4)).reshape(panels, per_row, -1)
    return torch.cat((codes, _by_block(blocks.scales), _by_block(blocks.offsets)), dim=-1).contiguous()


def pack_fp32_q8_blocks(blocks: Q8_0Blocks) -> torch.Tensor:
    """The kernel's layout for fp32 rows on Q8_0 blocks: uint8 ``[out / 16, in / 32, 544]``, a
    feature's 16 codes in 16 bytes (output by output), then d (fp16) a block (``fp32_q8_linear``)."""
    panels, per_row = _panels_and_blocks(blocks)
    codes = blocks.codes.view(panels, _PANEL, per_row, BLOCK).permute(0, 2, 3, 1)  # [panel, block, f, j]
    codes = codes.reshape(panels, per_row, -1).view(torch.uint8)
    return torch.cat((codes, _by_block(blocks.scales)), dim=-1).contiguous()


def _panels_and_blocks(blocks: Q4_1Blocks | Q8_0Blocks) -> tuple[int, int]:
    """(panels of 16 outputs, blocks of 32 inputs) of a weight the kernel can take."""
    rows, columns = blocks.codes.shape
    if rows % _PANEL or columns % BLOCK:
        raise ValueError(f"blocks of a {rows}x{columns} weight: outputs by {_PANEL}, inputs by {BLOCK}")
    return rows // _PANEL, columns // BLOCK


def _by_block(values: torch.Tensor) -> torch.Tensor:
    """Per-block values ``[out, in / 32]`` as each panel's block's bytes: ``[out / 16, in / 32, 16 values]``."""
    rows, per_row = values.shape
    return values.view(rows // _PANEL, _PANEL, per_row).transpose(1, 2).contiguous().view(torch.uint8)


@functools.cache
def block_q4_products() -> bool:
    """The block kernel runs on bf16 dot products here (AVX512-BF16 build)."""
    kernel = load_cpu_kernel("block_q4_linear")
    return kernel is not None and bool(kernel.block_q4_products())


def serves_blocks(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether a replica of ``dtype`` on ``device`` keeps Q4_1 weights as blocks (module docstring)."""
    if device.type != "cpu":
        return False
    if dtype == torch.float32:
        # The fp32 panels' hosts, and a build with the kernel's AVX2 path.
        return (
            {"avx2", "fma"} <= cpu_flags()
            and load_cpu_kernel("block_q4_linear") is not None
            and instruction_set("block_q4_linear") != "base"
        )
    return dtype == torch.bfloat16 and block_q4_products()


class BlockRecovery:
    """Collects, while a model loads, the blocks of each packable linear's weight from the fp32
    tensors that fill it (a merged weight from several, by rows; a tied head's from the
    embedding's), and hands them to the linears: Q4_1 for every replica that keeps blocks, Q8_0
    for fp32 ones (``fp32_q8_linear``)."""

    def __init__(self, model: nn.Module) -> None:
        linears = {
            id(module.weight): module
            for module in model.modules()
            if isinstance(module, PackableLinear) and module.pack_weight
        }
        self._linears = {
            name: linears[id(param)]
            for name, param in model.named_parameters(remove_duplicate=False)
            if id(param) in linears
        }
        self._parts: dict[str, dict[int, Q4_1Blocks | Q8_0Blocks | None]] = {}

    def offer(self, param: str, rows: tuple[int, int] | None, tensor: torch.Tensor) -> None:
        linear = self._linears.get(param)
        if linear is None:
            return
        blocks: Q4_1Blocks | Q8_0Blocks | None = recover_q4_1(tensor)
        if blocks is None and linear.weight.dtype == torch.float32:
            blocks = recover_q8_0(tensor)
        self._parts.setdefault(param, {})[0 if rows is None else rows[0]] = blocks

    def attach(self) -> int:
        """Give each linear whose every row was recovered, in one format, its packed blocks; how
        many got them."""
        attached = 0
        for param, parts in self._parts.items():
            linear = self._linears[param]
            blocks = _stacked_if_one_format([parts[start] for start in sorted(parts)])
            if (
                blocks is None
                or tuple(blocks.codes.shape) != tuple(linear.weight.shape)
                or blocks.codes.shape[0] % _PANEL
            ):
                continue
            if isinstance(blocks, Q8_0Blocks):
                linear.block_q8 = pack_fp32_q8_blocks(blocks)
            else:
                fp32 = linear.weight.dtype == torch.float32
                linear.block_q4 = pack_fp32_blocks(blocks) if fp32 else pack_blocks(blocks)
            attached += 1
        self._parts.clear()
        return attached
