"""CUDA graphs for steps that hold prompt tokens: each layer's work between attention calls.

A decode step is replayed whole (``cuda_graphs``): its shapes can be fixed in advance, one query
a request and keys padded to a captured length. A step holding prompt chunks cannot be: how its
queries split between requests, and how many keys each sees, change from step to step. Run
eagerly, such a step launches every operator of every layer from the host; for the default
model's 30 layers that is about 1,100 kernels, 23-37 ms of host time on the H200 and H100 hosts
measured, for a few ms of GPU work. A GPU serving any prompt traffic then spends most of its
steps launching.

Everything but attention depends on the number of tokens only: embeddings, norms, projections,
rotary, the MLP, and the head's rows for the sampled tokens. So a step's tokens are padded to
the next captured count, and the work between one attention call and the next is recorded as
one graph a count (``layers + 1`` pieces). A step replays piece i, runs layer i's attention
eagerly on the real tokens' q/k/v (writing their K/V into the cache and attending through the
step's metadata, as an eager step does), leaves its output where piece i + 1 reads it, and so
on. This is vLLM's piecewise CUDA graphs, with the split made at the attention module
(``AttentionMetadata.split_at``) rather than by a compiler.

Padding tokens (id 0, position 0) flow through the pieces and are never attended: attention
takes the first ``n`` rows only, and the padding rows' output is whatever its buffer held. Every
operator but attention works row by row, so nothing of a padding row reaches a real token, and
the padding rows' logits are not read. Models whose forward derives per-step state from the metadata outside attention
(Gemma 3 bands it for its sliding layers) opt out with ``supports_piecewise_graphs = False``.

Off CUDA the same padded steps run eagerly, the attention calls split out the same way: that is
how the CPU tests check the padding and the split against the eager step.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import structlog
import torch
from torch import nn

from cachet.engine.attention import AttentionMetadata

if TYPE_CHECKING:
    from torch.cuda.graphs import _POOL_HANDLE

log = structlog.get_logger(__name__)

# Token counts are captured in powers of two up to here, then in steps of it: a step pads to
# at most twice its tokens while small (where launching, not arithmetic, bounds it) and by
# less than this many tokens once large.
_DOUBLING_UP_TO = 256


def captured_token_counts(max_tokens: int) -> list[int]:
    """8, 16, .., 256, then every 256 up to ``max_tokens`` (which is always included)."""
    counts = [n for n in (8, 16, 32, 64, 128, 256) if n < max_tokens]
    counts += list(range(2 * _DOUBLING_UP_TO, max_tokens, _DOUBLING_UP_TO))
    return [*counts, max_tokens]


@dataclass
class _Split:
    """One attention call between two pieces: its module, where the piece before it leaves
    q/k/v, and where the piece after it reads the output from."""

    attention: nn.Module
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    out: torch.Tensor

    def attend(self, num_tokens: int, meta: AttentionMetadata) -> None:
        n = num_tokens
        self.out[:n].copy_(self.attention(self.q[:n], self.k[:n], self.v[:n], meta))


class _SharedBuffers:
    """The tensors that cross a piece's edge, one set for every layer and token count.

    Each piece copies its q/k/v into these and reads the attention's output from here, so what
    a capture leaves in the graphs' memory pool is only what lives inside one piece, which the
    other token counts' captures reuse. A set per layer and count would hold every count's q/k/v
    and output at once: gigabytes for an 8B model. One set is safe because a step replays its
    pieces in order, and a piece reads the output before its own attention overwrites it."""

    def __init__(self, max_tokens: int, max_samples: int) -> None:
        self.max_tokens = max_tokens
        self.max_samples = max_samples
        self._tensors: dict[tuple[str, tuple[int, ...], torch.dtype], torch.Tensor] = {}

    @property
    def nbytes(self) -> int:
        return sum(tensor.nbytes for tensor in self._tensors.values())

    def token_rows(self, role: str, like: torch.Tensor) -> torch.Tensor:
        return self._rows(role, like, self.max_tokens)

    def sample_rows(self, like: torch.Tensor) -> torch.Tensor:
        return self._rows("logits", like, self.max_samples)

    def _rows(self, role: str, like: torch.Tensor, capacity: int) -> torch.Tensor:
        key = (role, tuple(like.shape[1:]), like.dtype)
        if key not in self._tensors:
            self._tensors[key] = torch.zeros(capacity, *like.shape[1:], dtype=like.dtype, device=like.device)
        return self._tensors[key][: like.shape[0]]


class _PaddedStep:
    """One token count's fixed buffers, the metadata the pieces read, and once captured its graphs.

    Token ids and positions live in one device buffer, so loading a step is one host-to-device
    copy; the tokens' sequence lengths (dynamic RoPE reads them) and the sampled rows come
    from the step's own metadata, already on the device."""

    def __init__(
        self, model: nn.Module, tokens: int, samples: int, shared: _SharedBuffers, device: torch.device
    ) -> None:
        self.model = model
        self.tokens = tokens
        self.shared = shared
        self.inputs = torch.zeros(2 * tokens, dtype=torch.int64, device=device)
        self.host_inputs = torch.zeros_like(self.inputs, device="cpu")
        if device.type == "cuda":
            self.host_inputs = self.host_inputs.pin_memory()
        self.input_ids, self.positions = self.inputs.view(2, tokens)
        self.seq_lens = torch.zeros(tokens, dtype=torch.int64, device=device)
        self.sample_indices = torch.zeros(samples, dtype=torch.int64, device=device)
        self.meta = AttentionMetadata(
            slot_mapping=torch.zeros(0, dtype=torch.int64, device=device),
            token_seq_lens=self.seq_lens,
            groups=[],
            sample_indices=self.sample_indices,
            split_at=self._split_eagerly,
        )
        self.splits: list[_Split] = []
        self.graphs: list[torch.cuda.CUDAGraph] = []
        self.logits: torch.Tensor | None = None
        # The real step's token count and metadata while it runs eagerly; None: a pass that
        # leaves attention out (warming up, or naming the shared buffers' shapes).
        self._step: tuple[int, AttentionMetadata] | None = None

    def _split_eagerly(
        self, attention: nn.Module, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        split = _Split(attention, q, k, v, torch.zeros_like(q))
        if self._step is not None:
            split.attend(*self._step)
        return split.out

    def warm_up(self) -> torch.Tensor:
        """One pass with attention left out, so lazy state (cuBLAS handles, rotary tables) exists
        before a capture, which may not create it. Returns the logits it made."""
        self._step = None
        return self.model(self.input_ids, self.positions, self.meta)

    def allocate_shared(self) -> None:
        """Create the shared buffers at this count's shapes (call it on the largest count, before
        any capture, so that they are allocated outside the graphs' pool)."""

        def name_shapes(
            attention: nn.Module, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
        ) -> torch.Tensor:
            for role, tensor in (("q", q), ("k", k), ("v", v), ("out", q)):
                self.shared.token_rows(role, tensor)
            return torch.zeros_like(q)

        self.meta.split_at = name_shapes
        try:
            self.shared.sample_rows(self.warm_up())
        finally:
            self.meta.split_at = self._split_eagerly

    def capture(self, pool: _POOL_HANDLE) -> None:
        """Record the pieces: each attention call ends the graph in progress and starts the next."""
        shared = self.shared
        graphs = [torch.cuda.CUDAGraph()]
        splits: list[_Split] = []

        def split_into_next_graph(
            attention: nn.Module, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
        ) -> torch.Tensor:
            q_in, k_in, v_in = shared.token_rows("q", q), shared.token_rows("k", k), shared.token_rows("v", v)
            q_in.copy_(q)
            k_in.copy_(k)
            v_in.copy_(v)
            graphs[-1].capture_end()
            splits.append(_Split(attention, q_in, k_in, v_in, shared.token_rows("out", q)))
            graphs.append(torch.cuda.CUDAGraph())
            graphs[-1].capture_begin(pool=pool)
            return splits[-1].out

        self.meta.split_at = split_into_next_graph
        try:
            graphs[0].capture_begin(pool=pool)
            made = self.model(self.input_ids, self.positions, self.meta)
            logits = shared.sample_rows(made)
            logits.copy_(made)
            graphs[-1].capture_end()
        finally:
            self.meta.split_at = self._split_eagerly
        self.graphs, self.splits, self.logits = graphs, splits, logits

    def load(self, input_ids: list[int], positions: torch.Tensor, meta: AttentionMetadata) -> None:
        n, samples = len(input_ids), meta.sample_indices.numel()
        self.host_inputs.zero_()
        self.host_inputs[:n] = torch.tensor(input_ids, dtype=torch.int64)
        self.host_inputs[self.tokens : self.tokens + n] = positions
        self.inputs.copy_(self.host_inputs, non_blocking=True)
        self.seq_lens[:n].copy_(meta.token_seq_lens)
        self.seq_lens[n:].zero_()
        self.sample_indices[:samples].copy_(meta.sample_indices)
        self.sample_indices[samples:].zero_()

    def run(self, num_tokens: int, meta: AttentionMetadata) -> torch.Tensor:
        """The logits of every sampled row, padding rows included (``len(sample_indices)``)."""
        if not self.graphs:
            self._step = (num_tokens, meta)
            try:
                return self.model(self.input_ids, self.positions, self.meta)
            finally:
                self._step = None
        for graph, split in zip(self.graphs, self.splits, strict=False):
            graph.replay()
            split.attend(num_tokens, meta)
        self.graphs[-1].replay()
        assert self.logits is not None  # captured with the graphs
        return self.logits


class PiecewiseGraphs:
    """Steps of up to ``max_tokens`` tokens (and ``max_samples`` sampled rows) padded to captured
    token counts, their work between attention calls captured as CUDA graphs on a CUDA device."""

    def __init__(self, model: nn.Module, *, max_tokens: int, max_samples: int, device: torch.device) -> None:
        self.device = device
        self.token_counts = captured_token_counts(max_tokens)
        self._shared = shared = _SharedBuffers(max_tokens, max_samples)
        self._steps = {
            tokens: _PaddedStep(model, tokens, min(tokens, max_samples), shared, device)
            for tokens in self.token_counts
        }
        # Steps run padded, and how many of them were graph replays.
        self.runs = 0
        self.replays = 0

    def capture(self) -> None:
        """Record every token count, largest first so smaller ones reuse its memory; logs the time."""
        if self.device.type != "cuda":
            return
        start = time.perf_counter()
        counts = sorted(self._steps, reverse=True)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        pool = torch.cuda.graph_pool_handle()
        # Captures run on a side stream, as torch.cuda.graph's do: the default stream cannot capture.
        with torch.inference_mode(), torch.cuda.stream(side):
            # The largest count's pass names the shared buffers' shapes and warms up as it does.
            self._steps[counts[0]].allocate_shared()
            for tokens in counts[1:]:
                self._steps[tokens].warm_up()
            torch.cuda.synchronize(self.device)
            for tokens in counts:
                self._steps[tokens].capture(pool)
        torch.cuda.current_stream(self.device).wait_stream(side)
        torch.cuda.synchronize(self.device)
        log.info(
            "prompt steps captured as piecewise CUDA graphs",
            token_counts=self.token_counts,
            graphs=sum(len(step.graphs) for step in self._steps.values()),
            edge_buffer_mib=round(self.edge_buffer_bytes / 2**20, 1),
            seconds=round(time.perf_counter() - start, 2),
        )

    @property
    def edge_buffer_bytes(self) -> int:
        """Memory of the tensors that cross the pieces' edges, one set for every count (0 until
        captured): q/k/v and the attention's output at the largest count, the logits' rows."""
        return self._shared.nbytes

    def tokens_for(self, num_tokens: int, num_samples: int) -> int | None:
        """The smallest captured token count this step fits, or None where it must run eagerly."""
        for tokens in self.token_counts:
            if tokens >= num_tokens:
                step = self._steps[tokens]
                return tokens if num_samples <= step.sample_indices.numel() else None
        return None

    def run(
        self, tokens: int, input_ids: list[int], positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """Logits ``[samples, vocab]`` of one step; valid until the next ``run``."""
        step = self._steps[tokens]
        step.load(input_ids, positions, meta)
        with torch.inference_mode():
            logits = step.run(len(input_ids), meta)
        self.runs += 1
        self.replays += bool(step.graphs)
        return logits[: meta.sample_indices.numel()]
