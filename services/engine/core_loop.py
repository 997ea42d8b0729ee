"""The engine loop, whichever host runs it: it runs commands and steps, and says what happened.

EngineCore is not thread-safe and its ``step()`` blocks for a whole forward pass, so one
loop alone touches it. The asyncio side (``AsyncEngine``) talks to that loop only through
the messages of ``loop_messages``, so the loop can live on a thread of the server's process
or in a process of its own (``core_process``).

Commands run between steps, so a request joins or leaves the batch at a step boundary,
never in the middle of one, with one exception: while a step that carries batch (async
queue) work runs, the loop looks for commands between the model's layers, and between each
layer's attention and its MLP (``StepInbox``).
A new interactive request that can start at once (a free seat, free blocks, no grammar)
then gets its first token from a forward pass of its own, run there, and its report goes
out before the step's: an interactive arrival waits for half a layer of the backlog's step,
not for the whole of it. Where the engine has an arrival lane (``arrival_lane``: a CPU engine on
one math thread with a core to spare), that pass runs on the lane's thread instead and the
step goes on beside it; its report goes out at the first look after it ends, or at
the step's end, which waits for it. Aborts read then wait for the step's end: they free
blocks the step (or the lane) is still writing.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

from cachet.engine.block_pool import BlocksStored, KvEvent
from cachet.engine.engine_core import EngineCore
from cachet.engine.errors import InvalidRequest, RequestNotFound
from cachet.engine.grammar_matcher import RequestGrammar
from cachet.engine.loop_messages import (
    AbortRequest,
    AddRequest,
    Command,
    EngineDescription,
    EngineStats,
    Reply,
    StepInbox,
    StepReport,
    SubscribeKvEvents,
)
from cachet.engine.request_output import RequestOutput
from cachet.engine.scheduler import PRIORITIES, priority_of


@dataclass
class CoreLoop:
    """Drives one EngineCore: runs commands, steps, and says what happened (host-agnostic).

    ``arrivals_between_layers``: look for interactive arrivals between the layers of a step
    that carries batch work (off: they wait for the step's end, as every command does)."""

    core: EngineCore
    arrivals_between_layers: bool = True
    _kv_events: list[KvEvent] = field(init=False, default_factory=list)
    # Commands read inside a step that must wait for its end.
    _deferred: list[tuple[int, Command]] = field(init=False, default_factory=list)
    # Model time of the steps run between the layers of the step in flight.
    _interleaved_seconds: float = field(init=False, default=0.0)

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

    def step(self, clock: Callable[[], float], inbox: StepInbox | None = None) -> StepReport:
        """One engine step; its time is reported only when it ran the model (a step can find
        nothing to schedule, or only a grammar's refusal to send), less the time of the
        steps run between its layers (each reported on its own, through ``inbox``)."""
        steps_before = self.core.scheduler.counts.steps
        arrivals = None
        if inbox is not None and self.arrivals_between_layers:
            arrivals = partial(self._arrivals, inbox, clock)
        self._interleaved_seconds = 0.0
        started = clock()
        outputs = self.core.step(arrivals)
        elapsed = clock() - started - self._interleaved_seconds
        ran_model = self.core.scheduler.counts.steps != steps_before
        if inbox is not None:
            # Before the deferred aborts: the lane's pass may still write its requests' blocks.
            self._report_lane(inbox, wait=True)
        report = self._report(outputs, elapsed if ran_model else None)
        if inbox is not None:
            deferred, self._deferred = self._deferred, []
            for command_id, command in deferred:
                inbox.send(self.run(command_id, command))
        return report

    def _arrivals(self, inbox: StepInbox, clock: Callable[[], float]) -> None:
        commands = inbox.take()
        for command_id, command in commands:
            if isinstance(command, AbortRequest):
                self._deferred.append((command_id, command))
            else:
                inbox.send(self.run(command_id, command))
        reported = self._report_lane(inbox, wait=False)
        if self.core.scheduler.waiting.num_interactive:
            reported = self._start_arrivals(inbox, clock) or reported
        if commands and not reported:
            inbox.send(self.report_without_step())

    def _start_arrivals(self, inbox: StepInbox, clock: Callable[[], float]) -> bool:
        """Start the waiting interactive requests that can start: on the lane when it is free,
        else in the step's place (an arrival waits for no pass). Whether a report went out or
        is coming (the lane's, by the step's end at the latest)."""
        if self.core.lane_free:
            return self.core.start_arrivals()
        started = clock()
        outputs = self.core.step_arrivals()
        if outputs is None:
            return False
        elapsed = clock() - started
        self._interleaved_seconds += elapsed
        inbox.send(self._report(outputs, elapsed))
        return True

    def _report_lane(self, inbox: StepInbox, *, wait: bool) -> bool:
        """Send the report of the lane's pass once it has ended; whether one went out."""
        finished = self.core.finish_arrivals(wait=wait)
        if finished is None:
            return False
        inbox.send(self._report(*finished))
        return True

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
