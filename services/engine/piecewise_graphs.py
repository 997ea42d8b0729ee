"""CUDA graphs for steps that hold prompt tokens: each layer's work between attention calls.

A decode step is replayed whole (``cuda_graphs``): its shapes can be fixed in advance, one query
a request and keys padded to a captured length. A step holding prompt chunks cannot be: how its
queries split between requests, and how many keys each sees, change from step to step. Run
eagerly, such a step launches every operator of every layer from the host; for the default
model's 30 layers that is about 1,100 kernels, ~37 ms of host time on an H200 host's CPU for
~2.5 ms of GPU work. A GPU serving any prompt traffic then spends most of its steps launching.

Everything but attention depends on the number of tokens only: embeddings, norms, projections,
rotary, the MLP, and the head's rows for the sampled tokens. So a step's tokens are padded to
the next captured count, and the work between one attention call and the next is recorded as
one graph a count (``layers + 1`` pieces). A step replays piece i, runs layer i's attention
eagerly on the real tokens' q/k/v (writing their K/V into the cache and attending through the
step's metadata, as an eager step does), leaves its output where piece i + 1 reads it, and so
on. This is vLLM's piecewise CUDA graphs, with the split made at the attention module
(``AttentionMetadata.split_at``) rather than by a compiler.

Padding tokens (id 0, position 0) flow through the pieces and are never attended: attention
takes the first ``n`` rows only and the padding rows' output stays zero. Their logits are not
read. Models whose forward derives per-step state from the metadata outside attention
(Gemma 3 bands it for its sliding layers) opt out with ``supports_piecewise_graphs = False``.

Off CUDA the same padded steps run eagerly, the attention calls split out the same way: that is
how the CPU tests check the padding and the split against the eager step.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import structlog
import torch
from torch import nn

from cachet.engine.attention import AttentionMetadata

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
    """One attention call between two pieces: its module, the q/k/v the piece before it leaves
    in place, and the buffer the piece after it reads the output from."""

    attention: nn.Module
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    out: torch.Tensor

    def attend(self, num_tokens: int, meta: AttentionMetadata) -> None:
        n = num_tokens
        self.out[:n].copy_(self.attention(self.q[:n], self.k[:n], self.v[:n], meta))


class _PaddedStep:
    """One token count's fixed buffers, the metadata the pieces read, and once captured its graphs.

    Token ids and positions live in one device buffer, so loading a step is one host-to-device
    copy; the tokens' sequence lengths (dynamic RoPE reads them) and the sampled rows come
    from the step's own metadata, already on the device."""

    def __init__(self, model: nn.Module, tokens: int, samples: int, device: torch.device) -> None:
        self.model = model
        self.tokens = tokens
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
        # The real step's token count and metadata while it runs eagerly; None: a warm-up pass.
        self._step: tuple[int, AttentionMetadata] | None = None

    def _forward(self) -> None:
        self.splits = []
        self.logits = self.model(self.input_ids, self.positions, self.meta)

    def _split_eagerly(
        self, attention: nn.Module, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        split = _Split(attention, q, k, v, torch.zeros_like(q))
        self.splits.append(split)
        if self._step is not None:
            split.attend(*self._step)
        return split.out

    def warm_up(self) -> None:
        """One pass with attention left out, so lazy state (cuBLAS handles, rotary tables) exists
        before a capture, which may not create it."""
        self._step = None
        self._forward()

    def capture(self, pool: tuple[int, int]) -> None:
        """Record the pieces: each attention call ends the graph in progress and starts the next.

        The output buffer of each split is allocated between captures, outside the pool: the
        piece after it reads it, and nothing the pool hands out later may overlap it."""
        graphs = [torch.cuda.CUDAGraph()]

        def split_into_next_graph(
            attention: nn.Module, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
        ) -> torch.Tensor:
            graphs[-1].capture_end()
            split = _Split(attention, q, k, v, torch.zeros_like(q))
            self.splits.append(split)
            graphs.append(torch.cuda.CUDAGraph())
            graphs[-1].capture_begin(pool=pool)
            return split.out

        self.meta.split_at = split_into_next_graph
        try:
            graphs[0].capture_begin(pool=pool)
            self._forward()
            graphs[-1].capture_end()
        finally:
            self.meta.split_at = self._split_eagerly
        self.graphs = graphs

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

    def run(self, num_tokens: int, meta: AttentionMetadata) -> None:
        if not self.graphs:
            self._step = (num_tokens, meta)
            try:
                self._forward()
            finally:
                self._step = None
            return
        for graph, split in zip(self.graphs, self.splits, strict=False):
            graph.replay()
            split.attend(num_tokens, meta)
        self.graphs[-1].replay()


class PiecewiseGraphs:
    """Steps of up to ``max_tokens`` tokens (and ``max_samples`` sampled rows) padded to captured
    token counts, their work between attention calls captured as CUDA graphs on a CUDA device."""

    def __init__(self, model: nn.Module, *, max_tokens: int, max_samples: int, device: torch.device) -> None:
        self.device = device
        self.token_counts = captured_token_counts(max_tokens)
        self._steps = {
            tokens: _PaddedStep(model, tokens, min(tokens, max_samples), device)
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
            for tokens in counts:
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
            seconds=round(time.perf_counter() - start, 2),
        )

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
            step.run(len(input_ids), meta)
        self.runs += 1
        self.replays += bool(step.graphs)
        assert step.logits is not None  # every run sets them
        return step.logits[: meta.sample_indices.numel()]
