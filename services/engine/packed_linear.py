"""Linear weights reordered once, after loading, into oneDNN's blocked layout (CPU only).

A CPU forward pass of a small batch is bound by streaming the weights through the cores,
and ``F.linear`` on a plain row-major weight streams them slowly: on the dev box a
one-token pass of SmolLM2-135M (bf16) spent 38 of its 48 ms in matrix products, some
7 GB/s against the 30 GB/s one core reads a plain tensor at. The same products on
weights reordered for oneDNN take 1.6x less time at one row, 1.5x at 23 and 1.35x at 40
(1.07x at 300), with bit-identical results in bf16.

Inductor's CPU weight freezing does the same reorder; doing it here keeps eager mode
(no compile at start-up).

On a CPU whose oneDNN has no bf16 kernels (no AVX512-BF16 or AMX: AVX2 hosts), bf16 weights
are packed instead into the panels of ``csrc/panel_linear.cpp`` (``cpu_kernels``), whose
products widen each weight to fp32 in registers: a decode step then streams half the bytes of
fp32 weights, where torch's emulated bf16 products streamed them slower than fp32 (8.9 against
20.6 GB/s for the default model's head, one row, the dev box's two cores).

fp32 weights go into the kernel's fp32 panels on hosts with AVX2 and FMA (oneDNN's fp32
products there are slow at a decode's few rows: one step's products of the default model,
Zen 3 EPYC, two threads, 1 / 16 / 512 rows 31.9 / 64.7 / 945.9 ms against the panels' 25.0 /
45.6 / 861.2), and on AVX-512 hosts, where the kernel has a 16-wide tile: one step's products
of the default model's layers (head apart) at 1 / 4 / 16 / 64 / 512 rows took 0.70 / 0.73 /
0.65-0.72 / 0.72-0.90 / 0.92-0.97x oneDNN's time (an AVX-512 Xeon without bf16, two threads,
timed in turn in one process). One chain per output in feature order: a row's bits at every
row count, so fp32 products need no second copy for batch-invariant steps.

oneDNN's own bf16 products (AVX512-BF16 or AMX hosts) are slow at one to four rows: a decode
step of the default model's linears took 24.2 ms at one row, the kernel 13.4 (16.8 and 14.7 at
four rows; AVX512-BF16 EPYC, two threads). So there a bf16 linear keeps the kernel's panels
beside oneDNN's weight and runs a product of up to ``SMALL_BATCH_ROWS`` rows on them (an
agent's turn decoding alone, or a few beside it), at the cost of a second copy of the bf16 weights.
On such hosts the kernel is built with AVX512-BF16's dot products (``cpu_kernels``): one layer's
products of the default model at 1 / 4 / 16 / 64 / 512 rows take 0.57 / 0.60 / 0.86 / 1.02 /
1.10x oneDNN's time (the widening build: 0.83 / 1.63 / 2.74 / 3.63 / 4.01x). So without AMX the
threshold is 16 rows: a whole decode step of the default model in process took 46.5 -> 40.7 ms at
8 decodes, 65.0 -> 59.7 at 16, and 106.4 -> 111.7 at 32 had it been 32 (a Zen 4 EPYC, 2 threads;
level on a Zen 5). It stays at four rows for AMX hosts, whose oneDNN tiles are faster still at
many rows. With the kernel's 12-row tile (a Zen 5 EPYC, 2 threads) the layers' products at 16 /
32 / 64 / 128 / 512 rows take 1.00 / 0.70 / 0.80 / 0.87 / 1.05x oneDNN's time, while one
threshold of 64 for the head too made whole decode steps 0.80 / 0.98 / 1.02 / 1.09x as long at
24 / 32 / 48 / 64 decodes: the head's 49,152 outputs favour oneDNN from fewer rows (the Zen 4
measure above had the head under the layers' threshold too). So a layer
runs up to ``SMALL_BATCH_ROWS`` (128) rows on the panels and the head up to
``HEAD_SMALL_BATCH_ROWS`` (16): decode steps 0.83 / 0.84 / 0.85 / 0.88x as long at 24 / 32 / 48 /
64 decodes, prompt steps of 512 rows level.

On AMX hosts the same pair panels serve a third path: a group of two pair panels, interleaved
pair by pair ([in / 2][2][16][2]), is the layout oneDNN's batch-reduce micro-kernel (torch's
``cpublas::brgemm``) takes for a 32-column right-hand side, so products past ``SMALL_BATCH_ROWS`` and up to ``TILE_UNIT_ROWS`` rows run on
the tile unit through it, reading the panels in place (no third copy of the weights): a decode
step of the default model in process (ABBA, 2 threads) at 8 / 16 / 32 decodes took 40.9 / 54.2 /
87.3 ms through oneDNN's products and 35.3 / 40.7 / 72.0 through the tile unit.

Each panel kernel computes a row's product in one fixed order whatever the batch, but the two orders
differ: a token's bf16 product rounds one way among few rows and another among more, so
greedy tokens would depend on what shares the step. A batch-invariant step (``invariant_rows``:
a step holding a greedy or seeded request, ``ModelRunner``) therefore runs every product on the
panels, at every row count; on AMX hosts on the tile unit instead. Its rows are the same bits
alone or in any batch too (the tile unit sums each row over the features in one order whatever
the rows beside it, and the threads split output columns, never features: checked for every
row of batches of 1 to 512 rows of the default model's shapes), and a prompt's rows, which the
dot-product tiles compute at ~60 GFLOP/s a core, run there at 3x the speed. On an AMX Xeon
(family 6 model 207, two threads) a greedy cold 1,800-token prompt's first token took 5.2 ->
2.2 s in process, and batch-invariant decode steps of 1 / 4 / 8 decodes 26.9 / 34.1 / 46.4 ->
31.6 / 37.1 / 41.5 ms (the tile unit reads the weights slower at a row or two). A lone greedy
request comes out ahead when its uncached prompt is more than ~3x the tokens it decodes (an
agent's turn: thousands of tokens in, hundreds out), and steps of many decodes always do.

A packed weight cannot be read as a plain tensor (oneDNN's is opaque, of the same shape; the
panels are [out / 16, in, 16]), so a model that reads a linear's weight itself (absorbed MLA attention)
marks that linear ``pack_weight = False``. A tied head gets a packed copy of its own;
the embedding keeps the plain table its lookups need.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn
from torch.nn import functional as F

from cachet.engine.cpu_features import cpu_flags
from cachet.engine.cpu_kernels import instruction_set, load_cpu_kernel

_PACKABLE_DTYPES = (torch.float32, torch.bfloat16)
# Output features per panel of the bf16 kernel's layout.
_PANEL = 16
# Most rows a product runs on the bf16 kernel's panels beside oneDNN's bf16 weight (above:
# oneDNN), from the measurements in the module docstring: a layer's, and the output head's
# (``HEAD_SMALL_BATCH_ROWS``, its own since its many rows favour oneDNN sooner).
_AMX = "amx_bf16" in cpu_flags()
SMALL_BATCH_ROWS = 4 if _AMX else 128
HEAD_SMALL_BATCH_ROWS = 4 if _AMX else 16
# Most rows a product runs on the same panels through oneDNN's AMX micro-kernel
# (``tile_unit_linear``), past the small-batch rows, where the kernel has it (AMX hosts): one
# step's products of the default model's layers at 5 / 8 / 16 / 32 rows took 0.52 / 0.58 / 0.57
# / 0.56x oneDNN's time, its head 0.79 / 0.54 / 0.55 / 0.54x; at 64-128 rows the layers
# 0.79-0.89x but the head 1.5-1.6x, level from 256 (a Sapphire Rapids-class Xeon, 2 threads).
TILE_UNIT_ROWS = 32
# Most rows a product runs on a checkpoint's 4-bit blocks where a linear has them
# (``block_q4_weights``): one step's products of the default model's layers at 1 / 4 / 8 / 16
# rows took 0.42 / 0.45 / 0.93 / 1.36x the bf16 panels' time (a Zen 4 EPYC, 2 threads, the
# ``block_q4`` bench). Past a few rows the products are bound by the dot products, not by
# reading the weights, and the blocks add work.
BLOCK_Q4_ROWS = 4
# The same for fp32 rows, whose products on the blocks are the fp32 panels' bits, on a build whose
# fp32 panels take AVX-512's 16-wide tile: one step's layer products at 1 / 4 / 8 rows took 0.88 /
# 0.89 / 1.30x the panels' time on a Zen 4 (64 GB/s from two threads; the ``block_q4`` bench).
# Against the AVX2 panels the blocks are faster at every row count (``fp32_block_rows``).
BLOCK_Q4_FP32_ROWS = 4


class _Products(threading.local):
    invariant = False


_products = _Products()


@contextmanager
def invariant_rows() -> Iterator[None]:
    """Products inside run on one kernel at every row count: a row's result is the same bits
    whatever else is in the batch."""
    before, _products.invariant = _products.invariant, True
    try:
        yield
    finally:
        _products.invariant = before


class PackableLinear(nn.Linear):
    """An ``nn.Linear`` whose weight ``pack_linear_weights`` may reorder for oneDNN."""

    # False where a model reads this linear's weight as a plain tensor.
    pack_weight: bool = True
    # The weight is in the panel kernel's layout (set by pack_).
    panels: bool = False
    # Beside oneDNN's bf16 weight: the same weight in the kernel's panels, for products of up
    # to small_batch_rows rows.
    small_batch_panels: torch.Tensor | None = None
    small_batch_rows: int = SMALL_BATCH_ROWS
    # The checkpoint's Q4_1 blocks of the weight (``block_q4_weights``): products of up to
    # BLOCK_Q4_ROWS rows outside batch-invariant steps, and with block_q4_in_invariant_steps
    # every product of those steps.
    block_q4: torch.Tensor | None = None
    block_q4_in_invariant_steps: bool = False
    # The checkpoint's Q8_0 blocks of the weight (fp32 replicas; ``block_q4_weights``), used as
    # the fp32 Q4_1 blocks are: the same bits as the panels.
    block_q8: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.project(x, self.bias)

    def project(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``x @ weight.T (+ bias)``, on the packed weight when there is one."""
        if x.dtype == torch.float32 and (self.block_q4 is not None or self.block_q8 is not None):
            # The fp32 panels' bits either way: the choice is speed alone, in any step.
            most = fp32_block_rows()
            if most is None or x.numel() <= most * x.shape[-1]:
                if self.block_q4 is not None:
                    return _block_kernel().fp32_linear(x, self.block_q4, bias)
                return _block_kernel().fp32_q8_linear(x, self.block_q8, bias)
        elif self.block_q4 is not None and (
            self.block_q4_in_invariant_steps
            if _products.invariant
            else x.numel() <= BLOCK_Q4_ROWS * x.shape[-1]
        ):
            return _block_kernel().linear(x, self.block_q4, bias)
        if self.small_batch_panels is not None:
            if _products.invariant:
                if x.dtype == torch.bfloat16 and tile_unit_products():
                    return _panel_kernel().tile_unit_linear(x, self.small_batch_panels, bias)
                return _panel_kernel().linear(x, self.small_batch_panels, bias)
            if x.numel() <= self.small_batch_rows * x.shape[-1]:
                return _panel_kernel().linear(x, self.small_batch_panels, bias)
            if (
                x.numel() <= TILE_UNIT_ROWS * x.shape[-1]
                and x.dtype == torch.bfloat16
                and tile_unit_products()
            ):
                return _panel_kernel().tile_unit_linear(x, self.small_batch_panels, bias)
        if self.weight.is_mkldnn:
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, bias, "none", [], "")
        if self.panels:
            return _panel_kernel().linear(x, self.weight, bias)
        return F.linear(x, self.weight, bias)

    def blocks_serve_every_product(self) -> bool:
        """An fp32 linear with blocks, on a host where every fp32 product runs on them."""
        return (
            self.weight.dtype == torch.float32
            and (self.block_q4 is not None or self.block_q8 is not None)
            and fp32_block_rows() is None
        )

    def pack_(self) -> bool:
        """Pack the weight for oneDNN or the panel kernel, once (``pack_weight`` allowing), or
        free it where the blocks serve every product; whether it was now."""
        if not self.pack_weight or self.weight.is_mkldnn or self.panels or self.weight.is_meta:
            return False
        if self.blocks_serve_every_product():
            # Nothing reads the fp32 values again (``project``): packed, they were the default
            # model's 425 MB of layer panels and a 113 MB copy of the tied head, beside 96 MB of
            # blocks. The shape stays, on the meta device, so a reader that was missed fails
            # loudly rather than reading garbage.
            self.weight = nn.Parameter(self.weight.detach().to("meta"), requires_grad=False)
            return True
        weight = self.weight.detach().contiguous()
        # A new parameter, not a write into the old one: a tied head's old one is the
        # embedding's table, which lookups still read plain.
        if _panel_kernel_packs(weight.device, weight.dtype):
            if weight.shape[0] % _PANEL == 0:
                self.weight = nn.Parameter(_panel_kernel().pack_weight(weight), requires_grad=False)
                self.panels = True
                return True
            if not _onednn_packs(weight.device, weight.dtype):
                return False  # no whole panels, and oneDNN cannot take it: stays plain
        if _small_batch_panels_help(weight):
            self.small_batch_panels = _panel_kernel().pack_weight(weight)
        reordered = torch.ops.mkldnn._reorder_linear_weight(weight)
        self.weight = nn.Parameter(reordered, requires_grad=False)
        return True


def packs_linear_weights(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether linear weights of ``dtype`` on ``device`` can be packed here: for oneDNN (a CPU
    with oneDNN; bf16 where it has bf16 kernels for this CPU), or else for our panel kernel."""
    return _onednn_packs(device, dtype) or _panel_kernel_packs(device, dtype)


def _onednn_packs(device: torch.device, dtype: torch.dtype) -> bool:
    if device.type != "cpu" or dtype not in _PACKABLE_DTYPES or not torch.backends.mkldnn.is_available():
        return False
    return dtype != torch.bfloat16 or bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def _panel_kernel():  # noqa: ANN202 - a compiled extension module
    kernel = load_cpu_kernel("panel_linear")
    assert kernel is not None  # weights are packed for it only where it loaded
    return kernel


def _block_kernel():  # noqa: ANN202 - a compiled extension module
    kernel = load_cpu_kernel("block_q4_linear")
    assert kernel is not None  # a linear holds blocks only where it loaded
    return kernel


@functools.cache
def fp32_block_rows() -> int | None:
    """Most rows an fp32 product runs on a linear's blocks; None: every product. Where the fp32
    panels are the AVX2 build's, the blocks' kernel runs the panels' own tile on weights it
    rebuilds from a seventh of the bytes: one step's layer products of the default model at 1 / 8
    / 16 / 64 / 512 rows took 0.29 / 0.62 / 0.82 / 0.93 / 0.98x the panels' time (a Zen 3 EPYC,
    two threads, the two kernels alternated in one process)."""
    return None if instruction_set("panel_linear") == "avx2" else BLOCK_Q4_FP32_ROWS


@functools.cache
def tile_unit_products() -> bool:
    """Whether the panel kernel runs products on the tile unit here (AMX: ``TILE_UNIT_ROWS``)."""
    kernel = load_cpu_kernel("panel_linear")
    return _AMX and kernel is not None and bool(kernel.tile_unit_products())


def _small_batch_panels_help(weight: torch.Tensor) -> bool:
    """oneDNN packs this bf16 weight, and the kernel can run its small batches faster."""
    return (
        weight.dtype == torch.bfloat16
        and weight.shape[0] % _PANEL == 0
        and load_cpu_kernel("panel_linear") is not None
    )


def _panel_kernel_packs(device: torch.device, dtype: torch.dtype) -> bool:
    """Weights of ``dtype`` go into the panel kernel's layout here, in place of oneDNN's: bf16
    where oneDNN has no bf16 kernels, fp32 on a host with AVX2 (and FMA) or AVX-512."""
    if device.type != "cpu" or load_cpu_kernel("panel_linear") is None:
        return False
    if dtype == torch.bfloat16:
        return not _onednn_packs(device, dtype)
    return dtype == torch.float32 and {"avx2", "fma"} <= cpu_flags()


def pack_linear_weights(model: nn.Module) -> int:
    """Reorder every packable linear's weight in place; returns how many were packed.

    Call after the weights are loaded (and tied): loading writes plain tensors."""
    return sum(module.pack_() for module in model.modules() if isinstance(module, PackableLinear))
