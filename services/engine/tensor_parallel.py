"""Layers that hold one rank's slice of a tensor-parallel model, and the slice they read from a checkpoint.

A model is built already split: each parallel layer knows which rows or columns
of the full checkpoint tensor are its own (``checkpoint_slices``), so the loader
reads only those with safetensors' ``get_slice`` and no rank ever holds a full
weight. With one rank every range is the whole tensor and the layers are plain
linears and embeddings.

    column-parallel  W[out, in]: rows [start, stop)  -> output features split, no communication
    row-parallel     W[out, in]: cols [start, stop)  -> partial sums, one all-reduce
    vocab-parallel   W[vocab, hidden]: rows          -> embedding: masked lookup + all-reduce;
                                                        lm_head: logits slice, gathered by all-reduce

The all-reduce itself is supplied by ``distributed`` (the one module that owns
DeepSpeed); model code only calls ``TensorParallelRank.all_reduce_``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from cachet.engine.packed_linear import HEAD_SMALL_BATCH_ROWS, PackableLinear


def _no_reduce(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


@dataclass(frozen=True)
class TensorParallelRank:
    """This rank's place in its replica's tensor-parallel group; the default is a lone rank."""

    rank: int = 0
    size: int = 1
    # Sums a tensor over the group in place (every rank ends with the sum).
    all_reduce_: Callable[[torch.Tensor], torch.Tensor] = field(default=_no_reduce, repr=False, compare=False)
    # How a mixture-of-experts model spreads its routed experts over this group: ``size`` puts
    # whole experts on each rank (expert parallel), 1 cuts every expert by channels like a dense
    # MLP. Nothing in between: the group's ranks are the only ranks a replica has.
    expert_parallel_size: int = 1

    def __post_init__(self) -> None:
        if self.expert_parallel_size not in (1, self.size):
            raise ValueError(
                f"expert_parallel_size={self.expert_parallel_size} must be 1 or the "
                f"tensor-parallel size ({self.size})"
            )

    def split(self, units: int, what: str = "units") -> range:
        """This rank's share of ``units`` (heads, channels, vocabulary rows): as even as possible,
        lower ranks taking the remainder, so 3 KV heads over 2 ranks are 2 + 1."""
        if units < self.size:
            raise ValueError(f"{units} {what} cannot be split over {self.size} tensor-parallel ranks")
        base, extra = divmod(units, self.size)
        start = self.rank * base + min(self.rank, extra)
        return range(start, start + base + (self.rank < extra))


SINGLE_RANK = TensorParallelRank()


@dataclass(frozen=True)
class TensorSlice:
    """Which part of a checkpoint tensor a parameter holds: ``[start, stop)`` along ``dim``."""

    full_shape: tuple[int, ...]
    dim: int
    start: int
    stop: int

    @property
    def is_part(self) -> bool:
        return self.stop - self.start < self.full_shape[self.dim]

    def read(self, name: str, checkpoint_slice: object) -> torch.Tensor:
        """Read just this part from a safetensors ``get_slice`` handle."""
        shape = tuple(checkpoint_slice.get_shape())  # type: ignore[attr-defined]
        if shape != self.full_shape:
            raise ValueError(f"{name}: checkpoint shape {shape} != model shape {self.full_shape}")
        index = (slice(None),) * self.dim + (slice(self.start, self.stop),)
        return checkpoint_slice[index]  # type: ignore[index]


def _scaled(units: range, width: int) -> range:
    return range(units.start * width, units.stop * width)


class ColumnParallelLinear(PackableLinear):
    """Output features ``out_range`` of a ``[full_out, in]`` linear; the output stays split."""

    def __init__(self, in_features: int, full_out: int, out_range: range, bias: bool = False) -> None:
        super().__init__(in_features, len(out_range), bias=bias)
        self.full_out = full_out
        self.out_range = out_range

    @classmethod
    def by_units(
        cls,
        in_features: int,
        units: int,
        width: int,
        tp: TensorParallelRank,
        bias: bool = False,
        what: str = "",
    ) -> ColumnParallelLinear:
        """Split ``units`` blocks of ``width`` rows each (heads of head_dim; channels of 1)."""
        return cls(in_features, units * width, _scaled(tp.split(units, what or "units"), width), bias)

    def checkpoint_slices(self) -> dict[str, TensorSlice]:
        start, stop = self.out_range.start, self.out_range.stop
        slices = {"weight": TensorSlice((self.full_out, self.in_features), 0, start, stop)}
        if self.bias is not None:
            slices["bias"] = TensorSlice((self.full_out,), 0, start, stop)
        return slices


class MergedColumnParallelLinear(PackableLinear):
    """Several column-parallel linears over the same input, stacked into one product (q, k and v;
    an MLP's gate and up). One product of the stacked rows streams the input once and costs one
    call: a one-token step's q/k/v and gate/up took 1.5x less time merged on a CPU thread.

    ``parts``: checkpoint name -> (its full output rows, the rows this rank holds); the
    output is those ranks' rows in order, ``split`` by ``output_sizes``."""

    def __init__(self, in_features: int, parts: dict[str, tuple[int, range]], bias: bool = False) -> None:
        super().__init__(in_features, sum(len(rows) for _, rows in parts.values()), bias=bias)
        self.parts = parts
        self.output_sizes = [len(rows) for _, rows in parts.values()]

    def split(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The merged product of ``x``, cut back into one output per part."""
        return self(x).split(self.output_sizes, dim=-1)

    def checkpoint_parts(self) -> dict[str, tuple[str, int, TensorSlice]]:
        """Checkpoint tensor name (relative to this module) -> (this module's parameter, the row
        where that part starts in it, the part of the checkpoint tensor it holds)."""
        stacked: dict[str, tuple[str, int, TensorSlice]] = {}
        offset = 0
        for part, (full_out, rows) in self.parts.items():
            stacked[f"{part}.weight"] = (
                "weight",
                offset,
                TensorSlice((full_out, self.in_features), 0, rows.start, rows.stop),
            )
            if self.bias is not None:
                stacked[f"{part}.bias"] = ("bias", offset, TensorSlice((full_out,), 0, rows.start, rows.stop))
            offset += len(rows)
        return stacked


class RowParallelLinear(PackableLinear):
    """Input features ``in_range`` of a ``[out, full_in]`` linear: each rank's output is a partial sum.

    ``reduce=False`` leaves the sum to the caller, who adds several partials first and
    reduces once (the MoE block: routed and shared experts in one all-reduce).
    """

    def __init__(
        self,
        full_in: int,
        in_range: range,
        out_features: int,
        tp: TensorParallelRank,
        bias: bool = False,
        reduce: bool = True,
    ) -> None:
        super().__init__(len(in_range), out_features, bias=bias)
        self.full_in = full_in
        self.in_range = in_range
        self.tp = tp
        self.reduce = reduce

    @classmethod
    def by_units(
        cls,
        units: int,
        width: int,
        out_features: int,
        tp: TensorParallelRank,
        bias: bool = False,
        reduce: bool = True,
        what: str = "",
    ) -> RowParallelLinear:
        in_range = _scaled(tp.split(units, what or "units"), width)
        return cls(units * width, in_range, out_features, tp, bias, reduce)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.project(x)
        if self.reduce:
            self.tp.all_reduce_(out)
        # The bias once, after the sum: every rank holds all of it.
        return out if self.bias is None else out + self.bias

    def checkpoint_slices(self) -> dict[str, TensorSlice]:
        return {
            "weight": TensorSlice(
                (self.out_features, self.full_in), 1, self.in_range.start, self.in_range.stop
            )
        }


class VocabParallelEmbedding(nn.Embedding):
    """Rows ``vocab_range`` of the embedding table; a token outside them contributes zeros here
    and its row on the rank that holds it (one all-reduce)."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TensorParallelRank) -> None:
        vocab_range = tp.split(vocab_size, "vocabulary rows")
        table = torch.empty(len(vocab_range), hidden_size)
        # Built on the meta device (``load_model``) the checkpoint fills it: nn.Embedding's own
        # init there would be thrown away, and its normal_ loads torch's dynamo (~3 s of every
        # engine start on a 2-core host). Built for real (a test's random checkpoint), it draws
        # the values nn.Embedding would.
        if not table.is_meta:
            nn.init.normal_(table)
        super().__init__(len(vocab_range), hidden_size, _weight=table)
        self.vocab_size = vocab_size
        self.vocab_range = vocab_range
        self.tp = tp

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return super().forward(ids)
        start, stop = self.vocab_range.start, self.vocab_range.stop
        here = (ids >= start) & (ids < stop)
        out = super().forward(torch.where(here, ids - start, 0))
        out.masked_fill_(~here[:, None], 0)
        return self.tp.all_reduce_(out)

    def checkpoint_slices(self) -> dict[str, TensorSlice]:
        shape = (self.vocab_size, self.embedding_dim)
        return {"weight": TensorSlice(shape, 0, self.vocab_range.start, self.vocab_range.stop)}


class ParallelLMHead(PackableLinear):
    """Rows ``vocab_range`` of the output projection; every rank ends with the full logits.

    The slices meet by an all-reduce of a zero-padded ``[tokens, vocab]`` tensor rather than an
    all-gather: DeepSpeed's fast CPU collective is an all-reduce, and only sampling positions
    reach the head, so the tensor is a few rows. Its rows match ``VocabParallelEmbedding``'s,
    so a tied head shares the embedding's shard (on a CPU, packing then gives it a
    copy of its own: ``packed_linear``).
    """

    small_batch_rows = HEAD_SMALL_BATCH_ROWS

    def __init__(self, hidden_size: int, vocab_size: int, tp: TensorParallelRank) -> None:
        vocab_range = tp.split(vocab_size, "vocabulary rows")
        super().__init__(hidden_size, len(vocab_range), bias=False)
        self.vocab_size = vocab_size
        self.vocab_range = vocab_range
        self.tp = tp

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        local = self.project(hidden)
        if self.tp.size == 1:
            return local
        logits = local.new_zeros(hidden.shape[0], self.vocab_size)
        logits[:, self.vocab_range.start : self.vocab_range.stop] = local
        return self.tp.all_reduce_(logits)

    def checkpoint_slices(self) -> dict[str, TensorSlice]:
        shape = (self.vocab_size, self.in_features)
        return {"weight": TensorSlice(shape, 0, self.vocab_range.start, self.vocab_range.stop)}


def checkpoint_slices(model: nn.Module) -> dict[str, TensorSlice]:
    """Parameter name -> the part of the checkpoint tensor it holds, for every parameter that
    holds less than the whole (a lone rank's model, or a routed expert, has none)."""
    slices = {}
    for prefix, module in model.named_modules():
        if isinstance(
            module, ColumnParallelLinear | RowParallelLinear | VocabParallelEmbedding | ParallelLMHead
        ):
            for name, part in module.checkpoint_slices().items():
                if part.is_part:
                    slices[f"{prefix}.{name}" if prefix else name] = part
    return slices


def stacked_checkpoint_parts(model: nn.Module) -> dict[str, tuple[str, int, TensorSlice]]:
    """Checkpoint tensor name -> (parameter name, starting row, part held) for every tensor that
    fills only some rows of a merged parameter (``MergedColumnParallelLinear``)."""
    stacked = {}
    for prefix, module in model.named_modules():
        if isinstance(module, MergedColumnParallelLinear):
            # The parts are the merged module's siblings in a checkpoint (self_attn.q_proj).
            parent = prefix.rpartition(".")[0]
            for name, (param, offset, part) in module.checkpoint_parts().items():
                stacked[f"{parent}.{name}" if parent else name] = (f"{prefix}.{param}", offset, part)
    return stacked
