"""The engine loop, whichever host runs it: it runs commands and steps, and says what happened.

EngineCore is not thread-safe and its ``step()`` blocks for a whole forward pass, so one
loop alone touches it. The asyncio side (``AsyncEngine``) talks to that loop only through
the messages of ``loop_messages``, so the loop can live on a thread of the server's process
or in a process of its own (``core_process``).

Commands run between steps, so a request joins or leaves the batch at a step boundary,
never in the middle of one. How soon an interactive request runs beside a backlog is the
scheduler's choice (priority, a per-step token budget for batch work, preemption).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from cachet.engine.block_pool import KvEvent
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
    StepReport,
    SubscribeKvEvents,
)
from cachet.engine.request_output import RequestOutput
from cachet.engine.scheduler import PRIORITIES, priority_of


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

    def describe(
        self,
        *,
        expert_parallel_size: int,
        dtype: str,
        device: str,
        sampling_defaults: dict[str, float] | None = None,
    ) -> EngineDescription:
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
            sampling_defaults=dict(sampling_defaults or {}),
            vocab_size=getattr(runner, "vocab_size", 0),
            image_input=getattr(runner, "image_input", None),
            shared_tier_id=getattr(getattr(runner, "shared_kv", None), "tier_id", ""),
            reproducible_kernels=getattr(runner, "reproducible_kernels", ""),
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
                request.grammar = RequestGrammar.create(
                    compiler, command.grammar_spec, starts_after=command.grammar_starts_after
                )
            self.core.add_request(request)
            return None
        if isinstance(command, AbortRequest):
            try:
                self.core.abort(command.request_id)
            except RequestNotFound:
                return False
            return True
        assert isinstance(command, SubscribeKvEvents), command
        return self.core.scheduler.kv.snapshot_events()

    def has_work_now(self) -> bool:
        return self.core.has_work_now()

    def step(self) -> StepReport:
        """One engine step; its time is reported only when it ran the model (a step can find
        nothing to schedule, or only a grammar's refusal to send)."""
        outputs = self.core.step()
        return self._report(outputs, self.core.last_step_seconds)

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
        host_blocks, host_slots = scheduler.kv.num_host_blocks
        return EngineStats(
            running=running,
            waiting={"interactive": scheduler.waiting.num_interactive, "batch": scheduler.waiting.num_batch},
            interactive_left_waiting=scheduler.num_interactive_left_waiting,
            free_kv_blocks=scheduler.kv.num_free_blocks,
            total_kv_blocks=scheduler.kv.num_blocks,
            # A copy: the report outlives this step, the totals go on changing.
            counts=scheduler.counts.snapshot(),
            host_kv_blocks=host_blocks,
            host_kv_slots=host_slots,
            cached_tokens_by_tier=dict(scheduler.kv.hit_tokens),
            kv_block_copies=scheduler.kv.copies_by_direction,
            kv_block_copy_bytes=scheduler.kv.block_copy_bytes,
            kv_retained_blocks=scheduler.kv.num_retained_blocks,
            kv_block_retentions=scheduler.kv.block_retentions,
            batch_token_budget=scheduler.last_batch_token_budget,
        )
