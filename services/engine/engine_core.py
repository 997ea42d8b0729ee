"""The engine's life: ``step()`` = schedule -> run the model -> postprocess.

One EngineCore per replica, driven by one loop (rank 0); it is not thread-safe:
the caller serialises ``add_request``, ``abort`` and ``step``.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch
from tokenizers import Tokenizer

from cachet.engine.block_pool import BlockPool, KvEvent
from cachet.engine.errors import InvalidRequest
from cachet.engine.grammar_matcher import MaskBuilder, RequestGrammar, StepMasks
from cachet.engine.host_kv_tier import HostTierIndex
from cachet.engine.kv_cache_manager import KVCacheManager
from cachet.engine.kv_handoff import KvHandOffs
from cachet.engine.kv_transfer import KvSender
from cachet.engine.request import Request, RequestStatus
from cachet.engine.request_output import RequestOutput
from cachet.engine.scheduler import Scheduler, SchedulerConfig
from cachet.engine.step_plan import SampledToken, StepPlan, StepResult
from cachet.engine.stop_strings import StopStringChecker
from cachet.engine.structured_output import GrammarCompiler

# Prompt tokens decoded ahead of the output so its first token decodes as it
# would in context (e.g. SentencePiece's leading space).
_STOP_CONTEXT_TOKENS = 5


class Runner(Protocol):
    """What the engine needs from a model runner (``model_runner.ModelRunner``)."""

    num_kv_blocks: int
    block_size: int

    def execute(self, plan: StepPlan, logit_masks: Mapping[str, torch.Tensor] | None = None) -> StepResult:
        """``logit_masks``: request id -> bool [vocab], True = allowed (structured output)."""
        ...


@dataclass
class EngineCore:
    """Owns the scheduler (and through it the KV cache) and drives the runner.

    ``kv_event_sink`` receives each step's KV events (stored / removed /
    cleared), in order; without one they are dropped. ``grammar_compiler`` enables structured
    output (requests carrying a ``RequestGrammar``); ``wake`` is called from a compiler thread
    when a grammar becomes ready, so an idle loop can stop waiting.
    """

    runner: Runner
    model: str
    scheduler_config: SchedulerConfig
    tokenizer: Tokenizer | None = None
    enable_prefix_caching: bool = True
    kv_event_sink: Callable[[list[KvEvent]], None] | None = None
    grammar_compiler: GrammarCompiler | None = None
    wake: Callable[[], None] | None = None
    scheduler: Scheduler = field(init=False)
    _masks: MaskBuilder | None = field(init=False, default=None)
    # Requests whose grammar is still being built; reaped at each step.
    _compiling: dict[str, Request] = field(init=False, default_factory=dict)
    _stop_checkers: dict[str, StopStringChecker] = field(init=False, default_factory=dict)
    _pending: list[RequestOutput] = field(init=False, default_factory=list)
    _busy: bool = field(init=False, default=False)
    # Disaggregated prefill: answers held until their KV is delivered or written (kv_handoff).
    _handoffs: KvHandOffs | None = field(init=False, default=None)
    _sender: KvSender | None = field(init=False, default=None)
    # The last step's time, start to outputs; None when it ran no model (nothing scheduled).
    last_step_seconds: float | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        pool = BlockPool(self.runner.num_kv_blocks, enable_caching=self.enable_prefix_caching)
        host_slots = getattr(self.runner, "num_host_kv_blocks", 0)
        kv = KVCacheManager(
            pool,
            model=self.model,
            block_size=self.runner.block_size,
            host_tier=HostTierIndex(host_slots) if host_slots else None,
            shared_tier=getattr(self.runner, "shared_kv", None),
            received=getattr(getattr(self.runner, "kv_receiver", None), "blocks", None),
            block_bytes=getattr(self.runner, "kv_block_bytes", 0),
            reproducible_kernels=getattr(self.runner, "reproducible_kernels", ""),
        )
        self.scheduler = Scheduler(kv, self.scheduler_config)
        if kv.shared_tier is not None:
            kv.shared_tier.on_events = self._wake
        self._sender = getattr(self.runner, "kv_sender", None)
        if kv.shared_tier is not None or self._sender is not None:
            self._handoffs = KvHandOffs(kv.shared_tier, self._sender, self._wake)
        if self.grammar_compiler is not None:
            self._masks = MaskBuilder(self.grammar_compiler.vocab_size)

    # ---------------------------------------------------------------- requests

    def add_request(self, request: Request) -> None:
        """Queue a request; raises InvalidRequest or EngineOverloaded."""
        if request.sampling.stop and self.tokenizer is None:
            raise InvalidRequest("stop strings need the engine to have a tokenizer")
        if request.grammar is not None and self._masks is None:
            raise InvalidRequest("response_format needs the engine to have a tokenizer")
        if request.hand_off_kv and not (
            self.scheduler.kv.shared_tier is not None or (request.hand_off_to and self._sender is not None)
        ):
            raise InvalidRequest(
                "hand_off_kv needs the shared KV tier (CACHET_KV_SHARED_DIR) on this replica, or "
                "hand_off_to naming a decode replica's KV receiver"
                + ("" if self._sender is not None else " (this replica cannot send KV directly)")
            )
        if request.hand_off_to and not request.hand_off_kv:
            raise InvalidRequest("hand_off_to names where a hand-off's KV goes: it needs hand_off_kv")
        if request.prefilled_elsewhere:
            self._check_prefilled(request)
        self.scheduler.add_request(request)
        prefetch = self.scheduler.kv.start_prefetch(request)
        if prefetch is not None and self.wake is not None:
            wake = self.wake
            prefetch.add_done_callback(lambda _: wake())
        if request.grammar is not None and not request.grammar.ready:
            self._compiling[request.request_id] = request
            if self.wake is not None:
                request.grammar.on_ready(self.wake)
        if request.sampling.stop:
            checker = StopStringChecker(
                request.sampling.stop, self._decode, request.prompt_token_ids[-_STOP_CONTEXT_TOKENS:]
            )
            for token_id in request.output_token_ids:
                checker.append(token_id)  # the prefill replica's token: it matched no stop there
            self._stop_checkers[request.request_id] = checker
        if request.prefilled_elsewhere:
            # The caller's first token is already known: it goes out now, before the prompt's
            # KV is even loaded.
            self._pending.append(self._output(request, [SampledToken(request.output_token_ids[0])]))

    @staticmethod
    def _check_prefilled(request: Request) -> None:
        if len(request.output_token_ids) != 1:
            raise InvalidRequest("a request prefilled elsewhere carries exactly its first token")
        if request.grammar is not None:
            raise InvalidRequest("response_format cannot continue a token sampled on another replica")
        if request.sampling.logprobs:
            raise InvalidRequest("logprobs cannot be reported for a token sampled on another replica")
        if request.max_tokens < 2:
            raise InvalidRequest("a request prefilled elsewhere must leave max_tokens for decoding")

    def abort(self, request_id: str) -> None:
        """Abort now (blocks freed at once); its final output comes with the next step. RequestNotFound if unknown."""
        request = self.scheduler.abort(request_id)
        self._stop_checkers.pop(request_id, None)
        self._compiling.pop(request_id, None)
        self._pending.append(self._output(request, []))

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or bool(self._pending) or bool(self._handoffs)

    def has_work_now(self) -> bool:
        """Whether ``step()`` would do anything: not when every live request awaits its grammar."""
        return (
            bool(self._pending or self.scheduler.running)
            or self.scheduler.waiting.peek_ready() is not None
            # Blocks named by the last step still to be written to the shared tier, or written since.
            or self.scheduler.kv.has_pending_moves
            or self.scheduler.kv.has_pending_events
            # A failed grammar is never ready, but its refusal is work: the next step sends it.
            or any(r.grammar is not None and r.grammar.error is not None for r in self._compiling.values())
            or (self._handoffs is not None and self._handoffs.has_work_now)
        )

    # -------------------------------------------------------------------- step

    def step(self) -> list[RequestOutput]:
        """Run one forward pass over this step's batch; outputs of every request that changed.

        Who runs first, and how much batch work shares a step with interactive requests, is the
        scheduler's choice (priority, per-step token budget, preemption)."""
        started = time.perf_counter()
        self._reap_failed_grammars()
        plan = self.scheduler.schedule()
        result = StepResult() if plan.is_empty else self._execute(plan)
        if self._handoffs is not None:
            self._handoffs.after_execute()
        outputs = self._postprocess(plan, result)
        self.last_step_seconds = None
        if plan.num_scheduled_tokens:
            self.last_step_seconds = time.perf_counter() - started
            # The whole step, as an arrival waits for it: what sizes batch work beside interactive work.
            self.scheduler.step_cost.observe(plan.total_scheduled_tokens, self.last_step_seconds)
        self._check_when_idle()
        return outputs

    def _execute(self, plan: StepPlan) -> StepResult:
        masks = self._grammar_masks(plan)
        if masks is None:
            return self.runner.execute(plan)
        try:
            return self.runner.execute(plan, logit_masks=masks)
        finally:
            # A runner that failed may not have read every mask: the fill must be over before any
            # matcher is advanced or replayed again.
            masks.wait()

    def _grammar_masks(self, plan: StepPlan) -> StepMasks | None:
        """Start filling the token masks of the constrained requests that sample this step (their
        span reaches the end); the fill runs while the model computes the logits."""
        if self._masks is None:
            return None
        grammars: dict[str, RequestGrammar] = {}
        for request_id, num_tokens in plan.num_scheduled_tokens.items():
            request = self.scheduler.get_request(request_id)
            assert request is not None, request_id
            if request.grammar is not None and request.num_computed_tokens + num_tokens == request.num_tokens:
                # After a preemption the request re-prefills its output: the matcher must stand
                # after exactly those tokens (it does; sync verifies and repairs if not).
                request.grammar.sync(request.output_token_ids)
                if request.grammar.constraining:
                    grammars[request_id] = request.grammar
        return self._masks.start(grammars) if grammars else None

    def _reap_failed_grammars(self) -> None:
        """Forget requests whose grammar is built; refuse those whose grammar failed."""
        for request_id, request in list(self._compiling.items()):
            assert request.grammar is not None
            if request.grammar.ready:
                del self._compiling[request_id]
            elif (error := request.grammar.error) is not None:
                del self._compiling[request_id]
                self.scheduler.finish_request(request_id, RequestStatus.FINISHED_ERROR)
                self._stop_checkers.pop(request_id, None)
                self._pending.append(dataclasses.replace(self._output(request, []), error=error))

    def _postprocess(self, plan: StepPlan, result: StepResult) -> list[RequestOutput]:
        # A stop string matched by the same token wins: it names why the output stopped.
        matched_stops = self._advance_grammars(result) | self._match_stop_strings(result)
        updates = self.scheduler.update_from_step(plan, result, matched_stops)
        outputs, self._pending = self._pending, []
        if self._handoffs is not None:
            outputs += self._handoffs.take_released()
        for update in updates:
            output = self._output(update.request, [update.sampled])
            if update.request.is_finished:
                self._stop_checkers.pop(update.request.request_id, None)
                if update.request.hand_off_kv and self._handoffs is not None:
                    request = update.request
                    self._handoffs.hold(output, request.block_hashes[: request.timeline.kv_handed_off_blocks])
                    continue
            outputs.append(output)
        self._publish_kv_events()
        return outputs

    def _match_stop_strings(self, result: StepResult) -> dict[str, str]:
        """Feed each sampled token to its request's stop checker; request id -> stop string matched."""
        matched: dict[str, str] = {}
        for request_id, sampled in result.sampled.items():
            checker = self._stop_checkers.get(request_id)
            if checker is not None and (match := checker.append(sampled.token_id)) is not None:
                matched[request_id] = match.stop
        return matched

    def _advance_grammars(self, result: StepResult) -> dict[str, str]:
        """Feed each sampled token to its request's grammar; a completed grammar stops the request
        ("" as its matched stop: stopped, but by no stop string)."""
        completed: dict[str, str] = {}
        for request_id, sampled in result.sampled.items():
            request = self.scheduler.get_request(request_id)
            if request is None or request.grammar is None or request.status != RequestStatus.RUNNING:
                continue  # aborted while the step ran: its token is dropped, so is the grammar
            request.grammar.accept(sampled.token_id)
            if request.grammar.is_terminated:
                completed[request_id] = ""
        return completed

    def _wake(self) -> None:
        if self.wake is not None:
            self.wake()

    def _publish_kv_events(self) -> None:
        events = self.scheduler.kv.take_events()
        if events and self.kv_event_sink is not None:
            self.kv_event_sink(events)

    def _check_when_idle(self) -> None:
        """Verify every invariant each time the engine runs out of work."""
        busy = self.scheduler.has_unfinished_requests()
        if self._busy and not busy:
            self.scheduler.check_invariants()
        self._busy = busy

    def _decode(self, token_ids: Sequence[int]) -> str:
        assert self.tokenizer is not None
        return self.tokenizer.decode(token_ids)

    @staticmethod
    def _output(request: Request, sampled: list[SampledToken]) -> RequestOutput:
        return RequestOutput(
            request_id=request.request_id,
            new_token_ids=[s.token_id for s in sampled],
            logprobs=sampled if request.sampling.logprobs else [],
            status=request.status,
            matched_stop=request.stop_reason,
            num_prompt_tokens=request.num_prompt_tokens,
            num_cached_tokens=max(request.num_cached_tokens, 0),
            num_completion_tokens=len(request.output_token_ids),
            timeline=request.timeline if request.is_finished else None,
        )

    def reset_prefix_cache(self) -> bool:
        """Drop every cached prefix (emits a cleared event); only when no request holds blocks."""
        done = self.scheduler.kv.reset_prefix_cache()
        self._publish_kv_events()
        return done
