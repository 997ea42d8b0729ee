"""CUDA graphs for decode steps: one token per request, replayed instead of launched.

A decode step of a small or mid-sized model on a GPU is bound by the host launching its
kernels (a dozen or more per layer, a few microseconds each), not by the GPU running
them. A CUDA graph records the step's kernels once per shape and replays them with one
launch. Shapes must be fixed, so a decode step is padded: its batch to the next captured
batch size and its keys to the next captured context length. Padding rows write their
K/V into a scratch block that no request owns (the runner allocates it beyond the
blocks it reports) and attend one key; their logits are dropped.

Only steps where every request decodes one token and samples it are replayed; prefill
chunks, mixed steps and shapes past the largest captured one run eagerly, as before.
Models whose forward waits on the host (MoE routing that counts tokens per expert on
the host) opt out with ``supports_cuda_graphs = False``.

Off CUDA the same fixed-shape steps run eagerly without capture: that is how the CPU
tests check the padding, the scratch block and the key mask against the eager path.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import structlog
import torch
from torch import nn

from cachet.engine.attention import AttentionGroup, AttentionMetadata, SequenceSpan

log = structlog.get_logger(__name__)

# Batch sizes are captured up to here (and the engine's max_num_seqs, if lower): a decode
# batch past it is large enough that launching is no longer what bounds the step.
MAX_CAPTURED_BATCH = 128
# Context lengths are captured from here, doubling to the model's window: each decode reads
# keys padded to the next one, so this bounds the waste for short contexts.
MIN_CAPTURED_KV_LEN = 256
# A shape whose gathered K/V (one layer's, batch x keys) would pass this runs eagerly: a
# 128k-token window at batch 128 would otherwise gather tens of GB per layer.
MAX_GATHERED_KV_BYTES = 1 << 30


@dataclass(frozen=True, order=True)
class DecodeShape:
    batch: int
    kv_len: int


def captured_batch_sizes(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then every 8 up to ``max_batch`` (which is always included)."""
    sizes = [b for b in (1, 2, 4) if b < max_batch] + list(range(8, max_batch, 8))
    return [*sizes, max_batch]


def captured_kv_lengths(max_model_len: int, block_size: int) -> list[int]:
    """Powers of two from ``MIN_CAPTURED_KV_LEN``, then the window itself, each rounded up to
    whole blocks (a step's block table covers exactly its key length)."""

    def whole_blocks(tokens: int) -> int:
        return -(-tokens // block_size) * block_size

    window = whole_blocks(max_model_len)
    lengths: list[int] = []
    length = MIN_CAPTURED_KV_LEN
    while whole_blocks(length) < window:
        if not lengths or whole_blocks(length) > lengths[-1]:
            lengths.append(whole_blocks(length))
        length *= 2
    return [*lengths, window]


class _StaticDecodeStep:
    """One shape's fixed input buffers, the metadata the model reads from them, and its graph.

    Every integer input lives in one device buffer, so loading a step is one host-to-device
    copy: [input_ids | positions | slot_mapping | seq_lens | block_table (batch x blocks)].
    """

    def __init__(
        self,
        model: nn.Module,
        shape: DecodeShape,
        block_size: int,
        logits: torch.Tensor,
        device: torch.device,
    ) -> None:
        self.model = model
        self.shape = shape
        self.block_size = block_size
        self.logits = logits
        batch, blocks = shape.batch, shape.kv_len // block_size
        self.blocks_per_row = blocks
        self.inputs = torch.zeros(4 * batch + batch * blocks, dtype=torch.int64, device=device)
        self.host_inputs = torch.zeros_like(self.inputs, device="cpu")
        if device.type == "cuda":
            self.host_inputs = self.host_inputs.pin_memory()
        self.input_ids, self.positions, self.slot_mapping, self.seq_lens = self.inputs[: 4 * batch].view(
            4, batch
        )
        self.key_positions = torch.arange(shape.kv_len, device=device)
        self.mask = torch.zeros(batch, 1, 1, shape.kv_len, dtype=torch.bool, device=device)
        rows = torch.arange(batch, device=device)
        group = AttentionGroup(
            token_index=rows,
            padded_index=rows,
            block_table=self.inputs[4 * batch :].view(batch, blocks),
            seq_lens=self.seq_lens,
            mask=self.mask,
            batch_size=batch,
            max_query_len=1,
            max_kv_len=shape.kv_len,
        )
        self.meta = AttentionMetadata(
            slot_mapping=self.slot_mapping,
            token_seq_lens=self.seq_lens,
            groups=[group],
            sample_indices=rows,
            fixed_shapes=True,
        )
        self.graph: torch.cuda.CUDAGraph | None = None

    def forward(self) -> None:
        """What the graph records: the key mask from the loaded lengths, the model, the logits."""
        torch.lt(self.key_positions, self.seq_lens[:, None], out=self.mask.view(self.shape.batch, -1))
        self.logits[: self.shape.batch].copy_(self.model(self.input_ids, self.positions, self.meta))

    def load(self, spans: list[SequenceSpan], input_ids: list[int], scratch_slot: int) -> None:
        batch, size = self.shape.batch, self.block_size
        padding = batch - len(spans)
        positions = [span.num_computed for span in spans]
        slots = [
            span.block_ids[p // size] * size + p % size for span, p in zip(spans, positions, strict=True)
        ]
        table: list[int] = []
        for span, position in zip(spans, positions, strict=True):
            needed = position // size + 1
            table.extend(span.block_ids[:needed])
            table.extend([0] * (self.blocks_per_row - needed))
        # Padding rows: token 0 at position 0, written to the scratch slot, seeing key 0 only.
        values = (
            [*input_ids, *[0] * padding]
            + [*positions, *[0] * padding]
            + [*slots, *[scratch_slot] * padding]
            + [*(p + 1 for p in positions), *[1] * padding]
            + [*table, *[0] * (padding * self.blocks_per_row)]
        )
        self.host_inputs.copy_(torch.tensor(values, dtype=torch.int64))
        self.inputs.copy_(self.host_inputs, non_blocking=True)

    def run(self) -> None:
        if self.graph is not None:
            self.graph.replay()
        else:
            self.forward()


class DecodeGraphs:
    """Fixed-shape decode steps over a model whose KV cache the runner has bound, captured as
    CUDA graphs on a CUDA device. ``scratch_block`` is a KV block no request is ever given."""

    def __init__(
        self,
        model: nn.Module,
        *,
        vocab_size: int,
        block_size: int,
        max_batch: int,
        max_model_len: int,
        scratch_block: int,
        kv_bytes_per_key: int,
        device: torch.device,
    ) -> None:
        """``kv_bytes_per_key``: one token's K and V in one layer, as a decode gathers them."""
        self.device = device
        self.block_size = block_size
        self.scratch_slot = scratch_block * block_size
        self.batch_sizes = captured_batch_sizes(min(max_batch, MAX_CAPTURED_BATCH))
        self.kv_lengths = captured_kv_lengths(max_model_len, block_size)
        # One logits buffer for every shape: a graph's outputs would otherwise each hold
        # batch x vocab floats of their own.
        logits = torch.zeros(self.batch_sizes[-1], vocab_size, dtype=torch.float32, device=device)
        shapes = [DecodeShape(b, n) for b in self.batch_sizes for n in self.kv_lengths]
        self._steps = {
            shape: _StaticDecodeStep(model, shape, block_size, logits, device)
            for shape in shapes
            if shape.batch * shape.kv_len * kv_bytes_per_key <= MAX_GATHERED_KV_BYTES
        }
        # Steps run from fixed shapes, and how many of them were graph replays.
        self.runs = 0
        self.replays = 0

    def capture(self) -> None:
        """Record every shape, largest first so smaller ones reuse its memory; logs the time taken.

        Each shape runs once eagerly first: lazy state (cuBLAS handles, rotary tables) must
        exist before a capture, which may not allocate it."""
        if self.device.type != "cuda":
            return
        start = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        shapes = sorted(self._steps, reverse=True)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.inference_mode(), torch.cuda.stream(side):
            for shape in shapes:
                self._steps[shape].forward()
        torch.cuda.current_stream(self.device).wait_stream(side)
        with torch.inference_mode():
            for shape in shapes:
                step = self._steps[shape]
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    step.forward()
                step.graph = graph
        torch.cuda.synchronize(self.device)
        log.info(
            "decode steps captured as CUDA graphs",
            graphs=len(shapes),
            batch_sizes=self.batch_sizes,
            kv_lengths=self.kv_lengths,
            seconds=round(time.perf_counter() - start, 2),
        )

    def shape_for(self, spans: list[SequenceSpan]) -> DecodeShape | None:
        """The smallest captured shape this step fits, or None where it must run eagerly."""
        if not spans or len(spans) > self.batch_sizes[-1]:
            return None
        if any(span.num_new != 1 or not span.sample for span in spans):
            return None
        longest = max(span.num_computed for span in spans) + 1
        if longest > self.kv_lengths[-1]:
            return None
        batch = next(b for b in self.batch_sizes if b >= len(spans))
        kv_len = next(n for n in self.kv_lengths if n >= longest)
        shape = DecodeShape(batch, kv_len)
        return shape if shape in self._steps else None

    def run(self, shape: DecodeShape, spans: list[SequenceSpan], input_ids: list[int]) -> torch.Tensor:
        """Logits ``[len(spans), vocab]`` of one decode step; valid until the next ``run``."""
        step = self._steps[shape]
        step.load(spans, input_ids, self.scratch_slot)
        with torch.inference_mode():
            step.run()
        self.runs += 1
        self.replays += step.graph is not None
        return step.logits[: len(spans)]
