"""The one typed object the scheduler hands the model runner each step.

It is also what rank 0 broadcasts to the other ranks of a sharded replica, so
it holds only plain, picklable data and sends *diffs*: a request's prompt and
sampling parameters travel once (in ``new_requests``); afterwards only the
blocks it gained and its computed-token count do. The runner keeps the rest.

Token accounting, for one request in one step::

    all tokens:   [ .... computed .... | ... scheduled ... | not yet ]
                  0          num_computed_tokens    num_computed + num_scheduled

The runner computes KV for the scheduled span and samples one token when the
span reaches the end of the request's known tokens (a prefill chunk that stops
mid-prompt samples nothing).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from cachet.engine.prompt_images import PromptImage
from cachet.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class NewRequest:
    """A request the runner has not seen (or must rebuild after preemption)."""

    request_id: str
    prompt_token_ids: list[int]
    # Tokens generated before a preemption; recomputed like prompt tokens.
    output_token_ids: list[int]
    sampling: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    # Its prompt's images: each rank runs the vision tower itself (it is small beside the
    # language model, and replicated).
    images: tuple[PromptImage, ...] = ()

    def __repr__(self) -> str:
        return (
            f"NewRequest(id={self.request_id!r}, prompt={len(self.prompt_token_ids)} tok, "
            f"blocks={len(self.block_ids)}, computed={self.num_computed_tokens})"
        )


@dataclass(frozen=True)
class RunningRequestDiff:
    """What changed for a request the runner already holds."""

    request_id: str
    new_block_ids: list[int]
    num_computed_tokens: int


class LoadedBlock:
    """A block read from the shared KV tier, for a ``fill`` order: its hash and the reading
    rank's shard of it. Sent to the other ranks of a tensor-parallel replica it carries only
    its hash, and each of them reads its own shard's file (``shared_kv_tier``)."""

    __slots__ = ("block_hash", "data")

    def __init__(self, block_hash: int, data: torch.Tensor | None = None) -> None:
        self.block_hash = block_hash
        self.data = data

    def __reduce__(self) -> tuple[type[LoadedBlock], tuple[int]]:
        return LoadedBlock, (self.block_hash,)


@dataclass(frozen=True)
class KvBlockMoves:
    """Copies of KV blocks, done before the step's forward pass, in this order: those that read
    pool blocks about to be reused (``send`` (pool block id, hash, receiver address) to another
    replica, ``store`` (pool block id, hash) to the shared file tier, ``demote`` (pool block id, host slot) to the host tier), then ``duplicate`` (source pool
    block id, destination pool block id: copy-on-write of a prompt's last block that another
    live request computed, ``KVCacheManager.get_computed_blocks``), then ``fill`` (host slot,
    ``LoadedBlock``), then ``promote`` (host slot, pool block id).

    A duplicate's destination is a fresh block, which may be one this step's allocations
    evicted: it is written after the demotion that reads it. Its source may be freed and taken
    again in the same step (its holder preempted after the order was given): it is read before
    any promotion or forward pass writes it."""

    demote: list[tuple[int, int]] = field(default_factory=list)
    promote: list[tuple[int, int]] = field(default_factory=list)
    store: list[tuple[int, int]] = field(default_factory=list)
    fill: list[tuple[int, LoadedBlock]] = field(default_factory=list)
    duplicate: list[tuple[int, int]] = field(default_factory=list)
    send: list[tuple[int, int, str]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.demote or self.promote or self.store or self.fill or self.duplicate or self.send)


@dataclass(frozen=True)
class StepPlan:
    """Everything the runner needs for one forward pass."""

    new_requests: list[NewRequest] = field(default_factory=list)
    running: list[RunningRequestDiff] = field(default_factory=list)
    # request id -> tokens to compute this step (new and running alike).
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    # Requests that ended or were preempted since the last step: the runner drops them.
    finished_request_ids: set[str] = field(default_factory=set)
    kv_moves: KvBlockMoves = field(default_factory=KvBlockMoves)

    @property
    def total_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())

    @property
    def is_empty(self) -> bool:
        """Nothing for the runner: no tokens and no KV copies (a copy order must never be lost:
        the host tier already names the slot it fills)."""
        return not self.num_scheduled_tokens and not self.kv_moves

    def __repr__(self) -> str:
        return (
            f"StepPlan(new={len(self.new_requests)}, running={len(self.running)}, "
            f"tokens={self.total_scheduled_tokens}, finished={len(self.finished_request_ids)})"
        )


@dataclass(frozen=True)
class SampledToken:
    """One sampled token and, when asked for, its log-probabilities."""

    token_id: int
    logprob: float | None = None
    # (token id, logprob) of the most likely alternatives, best first.
    top_logprobs: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class StepResult:
    """What the runner returns: a token for every request that sampled this step."""

    sampled: dict[str, SampledToken] = field(default_factory=dict)
