"""What crosses between the engine loop and the server: commands in, replies and step reports out.

* in: commands (``AddRequest``, ``AbortRequest``, ``SubscribeKvEvents``), each with an id;
* out, in order on one channel: a ``Reply`` per command, and a ``StepReport`` after each
  step (and after a round of commands): the outputs, the KV events, the step's time and
  the scheduler's figures (``EngineStats``) as they stand.

Everything here is plain picklable data with no model code behind it: the server process
of a replica whose loop runs in a process of its own never imports torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from cachet.engine.block_pool import KvEvent
from cachet.engine.prompt_images import ImageInputSpec
from cachet.engine.request import Request
from cachet.engine.request_output import RequestOutput
from cachet.engine.scheduler import SchedulerConfig, SchedulerCounts
from cachet.engine.structured_output import GrammarSpec


@dataclass(frozen=True)
class AddRequest:
    request: Request
    # Compiled where the loop runs: a compiled grammar cannot cross a process boundary.
    grammar_spec: GrammarSpec | None = None
    # The grammar holds only the output after this token (engine.proto's constrain_after_token_id).
    grammar_starts_after: int | None = None


@dataclass(frozen=True)
class AbortRequest:
    """Replied with whether a live request was aborted (False: finished, or never existed)."""

    request_id: str


@dataclass(frozen=True)
class SubscribeKvEvents:
    """Replied with the block hashes cached now; later steps' events follow in their reports."""


Command = AddRequest | AbortRequest | SubscribeKvEvents


@dataclass(frozen=True)
class Reply:
    command_id: int
    value: Any = None
    error: BaseException | None = None


@dataclass(frozen=True)
class EngineStats:
    """The scheduler's figures after a step: load reports and metrics read these."""

    running: dict[str, int]  # by priority
    waiting: dict[str, int]  # by priority, preempted requests included
    # Ready interactive requests the last schedule could not admit (the headroom rule's signal).
    interactive_left_waiting: int
    free_kv_blocks: int
    total_kv_blocks: int
    counts: SchedulerCounts
    # The host tier's blocks held and slots (0, 0 without one).
    host_kv_blocks: int = 0
    host_kv_slots: int = 0
    # Totals since start: prompt tokens served from each tier ("engine", "host"), and blocks
    # copied each way between the pool and the host tier ("demote", "promote").
    cached_tokens_by_tier: dict[str, int] = field(default_factory=dict)
    kv_block_copies: dict[str, int] = field(default_factory=dict)
    kv_block_copy_bytes: dict[str, int] = field(default_factory=dict)
    # Blocks under a live retention now, in the pool and the host tier ("engine", "host"); and
    # blocks put under retention as their requests ended, since start.
    kv_retained_blocks: dict[str, int] = field(default_factory=dict)
    kv_block_retentions: int = 0
    # Most tokens of batch work a step carries beside interactive work now (Scheduler.batch_token_budget).
    batch_token_budget: int = 0

    @property
    def num_running(self) -> int:
        return sum(self.running.values())

    @property
    def num_waiting(self) -> int:
        return sum(self.waiting.values())


@dataclass(frozen=True)
class StepReport:
    outputs: list[RequestOutput]
    kv_events: list[KvEvent]
    # Wall time of the step; None when no step ran (a round of commands only).
    step_seconds: float | None
    stats: EngineStats


@dataclass(frozen=True)
class EngineDescription:
    """What the server needs to know of the loop's engine before it serves."""

    model: str
    context_window: int
    block_size: int
    total_kv_blocks: int
    expert_parallel_size: int
    dtype: str
    device: str
    scheduler_config: SchedulerConfig
    structured_output: bool
    stats: EngineStats
    # What a request leaves unset takes these (sampling_params.model_sampling_defaults).
    sampling_defaults: dict[str, float] = field(default_factory=dict)
    # Token ids the model has (0: unknown); a request naming another is refused, not run.
    vocab_size: int = 0
    # The images the model reads (None: text only).
    image_input: ImageInputSpec | None = None
    # The shared KV folder's id and layout key (shared_kv_tier.SharedKvFiles.tier_id); "": none.
    shared_tier_id: str = ""
    # What runs its batch-invariant steps (ModelRunner.reproducible_kernels); "": none.
    reproducible_kernels: str = ""


Message = Reply | StepReport
