"""The engine loop, whichever host runs it: what goes in, what comes out, and the loop itself.

EngineCore is not thread-safe and its ``step()`` blocks for a whole forward pass, so one
loop alone touches it. The asyncio side (``AsyncEngine``) talks to that loop only through
messages, so the loop can live on a thread of the server's process or in a process of its
own (``core_process``):

* in: commands (``AddRequest``, ``AbortRequest``, ``SubscribeKvEvents``), each with an id;
* out, in order on one channel: a ``Reply`` per command, and a ``StepReport`` after each
  step (and after a round of commands): the outputs, the KV events, the step's time and
  the scheduler's figures (``EngineStats``) as they stand.

Commands run between steps, so a request joins or leaves the batch at a step boundary,
never in the middle of one. Everything that crosses is plain data (picklable).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from cachet.engine.block_pool import BlocksStored, KvEvent
from cachet.engine.engine_core import EngineCore, RequestOutput
from cachet.engine.errors import InvalidRequest, RequestNotFound
from cachet.engine.grammar_matcher import RequestGrammar
from cachet.engine.request import Request
from cachet.engine.scheduler import PRIORITIES, SchedulerConfig, SchedulerCounts, priority_of
from cachet.engine.structured_output import GrammarSpec


@dataclass(frozen=True)
class AddRequest:
    request: Request
    # Compiled where the loop runs: a compiled grammar cannot cross a process boundary.
    grammar_spec: GrammarSpec | None = None


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


Message = Reply | StepReport


@dataclass
class CoreLoop:
    """Drives one EngineCore: runs commands, steps, and says what happened (host-agnostic)."""

    core: EngineCore
    _kv_events: list[KvEvent] = field(init=False, default_factory=list)

    def __post_init__(self) -> None:
        self.core.kv_event_sink = self._kv_events.extend

    def set_wake(self, wake: Callable[[], None]) -> None:
        """``wake`` is called from a compiler thread when a grammar is ready: an idle host that
        waits for commands must stop waiting."""
        self.core.wake = wake

    def describe(self, *, expert_parallel_size: int, dtype: str, device: str) -> EngineDescription:
        runner = self.core.runner
        return EngineDescription(
            model=self.core.model,
            context_window=self.core.scheduler_config.max_model_len,
            block_size=runner.block_size,
            total_kv_blocks=runner.num_kv_blocks,
            expert_parallel_size=expert_parallel_size,
            dtype=dtype,
            device=device,
            scheduler_config=self.core.scheduler_config,
            structured_output=self.core.grammar_compiler is not None,
            stats=self.stats(),
        )

    def run(self, command_id: int, command: Command) -> Reply:
        try:
            return Reply(command_id, value=self._run(command))
        except Exception as error:  # noqa: BLE001 - a domain error goes back to its caller
            return Reply(command_id, error=error)

    def _run(self, command: Command) -> object:
        if isinstance(command, AddRequest):
            request = command.request
            if command.grammar_spec is not None:
                compiler = self.core.grammar_compiler
                if compiler is None:
                    raise InvalidRequest(
                        "response_format needs a tokenizer, and this engine's model has none"
                    )
                request.grammar = RequestGrammar.create(compiler, command.grammar_spec)
            self.core.add_request(request)
            return None
        if isinstance(command, AbortRequest):
            try:
                self.core.abort(command.request_id)
            except RequestNotFound:
                return False
            return True
        assert isinstance(command, SubscribeKvEvents), command
        snapshot = sorted(self.core.scheduler.kv.cached_block_hashes())
        return [BlocksStored(tuple(snapshot), None)] if snapshot else []

    def has_work_now(self) -> bool:
        return self.core.has_work_now()

    def step(self, clock: Callable[[], float]) -> StepReport:
        """One engine step; its time is reported only when it ran the model (a step can find
        nothing to schedule, or only a grammar's refusal to send)."""
        steps_before = self.core.scheduler.counts.steps
        started = clock()
        outputs = self.core.step()
        elapsed = clock() - started
        ran_model = self.core.scheduler.counts.steps != steps_before
        return self._report(outputs, elapsed if ran_model else None)

    def report_without_step(self) -> StepReport:
        return self._report([], None)

    def _report(self, outputs: list[RequestOutput], step_seconds: float | None) -> StepReport:
        events, self._kv_events[:] = list(self._kv_events), []
        return StepReport(outputs, events, step_seconds, self.stats())

    def stats(self) -> EngineStats:
        scheduler = self.core.scheduler
        running = dict.fromkeys(PRIORITIES, 0)
        for request in scheduler.running:
            running[priority_of(request)] += 1
        return EngineStats(
            running=running,
            waiting={"interactive": scheduler.waiting.num_interactive, "batch": scheduler.waiting.num_batch},
            interactive_left_waiting=scheduler.num_interactive_left_waiting,
            free_kv_blocks=scheduler.kv.num_free_blocks,
            total_kv_blocks=scheduler.kv.num_blocks,
            # A copy: the report outlives this step, the totals go on changing.
            counts=scheduler.counts.snapshot(),
        )
