"""Continuous batching with a per-step token budget and chunked prefill.

Each step spends at most ``max_num_batched_tokens`` tokens. There is no prefill
or decode phase: every running request asks for the tokens it has not computed
yet (1 when decoding, the rest of its prompt when prefilling) and gets what the
budget still holds, so a long prompt is computed in chunks across steps.
Decoding requests are served first, so a long prompt never stalls them.
Interactive requests are admitted before batch (async queue) ones. While any
interactive request is running or waiting, batch work spends at most
``batch_token_budget()`` tokens of a step, and the step that starts
an interactive request carries none of its prompt work (its decodes, a token
each, go on): an interactive arrival waits for the step in flight and then its
own, so what batch work adds to a step's time is what it costs interactive
latency. The budget is that time: tokens that lengthen a step by at most
``batch_step_allowance`` times its fixed cost, by the step costs measured
(``step_cost``). On a GPU, where a step barely grows with its tokens, that is the
whole step; on a CPU a few dozen tokens.

When the KV pool runs dry, the most recently arrived running request (batch
work before interactive work) is preempted by recompute: its blocks are freed
and it goes back to the front of the waiting queue; when it resumes it
re-prefills prompt + output, mostly from the prefix cache. An interactive
request that finds every seat taken preempts the newest batch request the same
way, so batch work never makes interactive work wait for a seat (a long batch
generation could hold one for many seconds).
"""

from __future__ import annotations

import copy
import itertools
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field, fields

from cachet.engine.errors import EngineOverloaded, InvalidRequest, RequestNotFound
from cachet.engine.kv_cache_manager import KVCacheManager, cdiv
from cachet.engine.request import Request, RequestStatus
from cachet.engine.step_cost import StepCostModel
from cachet.engine.step_plan import (
    KvBlockMoves,
    NewRequest,
    RunningRequestDiff,
    SampledToken,
    StepPlan,
    StepResult,
)
from cachet.engine.waiting_queue import WaitingQueue
from cachet.sampling_ranges import check_context_window, check_value


@dataclass(frozen=True)
class SchedulerConfig:
    """Limits of one replica's scheduler; validated when built."""

    # Longest prompt + completion the model accepts (its context window).
    max_model_len: int
    max_num_batched_tokens: int = 512
    max_num_seqs: int = 64
    max_waiting: int = 256
    # The model's end-of-sequence ids; ignored by requests with ignore_eos.
    eos_token_ids: tuple[int, ...] = ()
    # Most tokens of batch (async queue) work in one step while interactive requests are
    # about; None: what ``batch_step_allowance`` allows (a quarter of the step's budget until
    # the step costs are known). An interactive arrival waits for the step in flight: batch
    # work must not make that step long.
    max_batch_tokens_per_step: int | None = None
    # While interactive requests are about, batch work may lengthen a step by at most this
    # many times the step's fixed cost (its time at no tokens, measured). Lower keeps first
    # tokens nearer their time without a backlog and drains it more slowly: on a 2-core CPU
    # with the default model (docs/measurements/async_queue.md), a Zen 4 in bf16: 1.5 read
    # first-token p50 / p99 1.80 / 2.08x with the backlog drawing 0.61 of the free capacity,
    # 0.75 1.12-1.22 / 1.18-1.23x and 0.48-0.52; a Zen 3 in fp32: the quarter-step budget
    # before it 2.81 / 2.91x and 0.93, 1.5 1.53-1.71 / 1.74-1.89x and 0.73-0.77, 0.75 1.33 /
    # 2.06x and 0.52.
    batch_step_allowance: float = 0.75
    # Batch work starts only while fewer requests than this run (all priorities); None: any
    # free seat. The seats above it stay open to interactive arrivals, and batch requests
    # beyond it wait here, ready to take a seat at the step a batch request ends.
    max_batch_running: int | None = None

    def __post_init__(self) -> None:
        if (
            min(self.max_model_len, self.max_num_batched_tokens, self.max_num_seqs) < 1
            or self.max_waiting < 0
        ):
            raise ValueError(f"scheduler limits must be positive: {self}")
        if not self.batch_step_allowance > 0:
            raise ValueError(f"batch_step_allowance must be positive: {self}")
        if self.max_batch_running is not None and not 1 <= self.max_batch_running <= self.max_num_seqs:
            raise ValueError(f"max_batch_running must be within 1..max_num_seqs: {self}")
        # Every decoding request gets its token each step only if the budget covers them all.
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError("max_num_batched_tokens must be >= max_num_seqs")


PRIORITIES = ("interactive", "batch")
PHASES = ("prefill", "decode")
PREEMPTION_REASONS = ("kv_cache", "seat")
FINISHED_STATUSES = tuple(status.name for status in RequestStatus if status.is_finished)


def priority_of(request: Request) -> str:
    """The ``priority`` label of a request's figures."""
    return "interactive" if request.interactive else "batch"


@dataclass
class SchedulerCounts:
    """Running totals since start, for the engine's metrics and load reports.

    Kept by the scheduler because it alone sees every plan and why a request lost its seat.
    Bumped on the engine thread, read from others: every key exists from the start, so a
    reader iterating a dict never sees it change size.
    """

    steps: int = 0
    # Sum over steps of the requests in a step: over ``steps``, the mean batch.
    scheduled_requests: int = 0
    # (priority, phase) -> tokens run through the model. "decode" is the one token a
    # generating request adds per step; "prefill" is the rest (prompt chunks, and the
    # recompute of a preempted request's prompt and output).
    computed_tokens: dict[tuple[str, str], int] = field(
        default_factory=lambda: {(p, phase): 0 for p in PRIORITIES for phase in PHASES}
    )
    # priority -> tokens sampled.
    generated_tokens: dict[str, int] = field(default_factory=lambda: dict.fromkeys(PRIORITIES, 0))
    # "kv_cache" (the pool ran dry) or "seat" (an interactive arrival took a batch request's seat).
    preemptions: dict[str, int] = field(default_factory=lambda: dict.fromkeys(PREEMPTION_REASONS, 0))
    # RequestStatus name of a finished request -> how many.
    finished_requests: dict[str, int] = field(default_factory=lambda: dict.fromkeys(FINISHED_STATUSES, 0))

    def snapshot(self) -> SchedulerCounts:
        """A copy that later steps do not change (what a step report carries)."""
        return SchedulerCounts(**{f.name: copy.copy(getattr(self, f.name)) for f in fields(self)})

    @property
    def prefill_tokens(self) -> int:
        return sum(n for (_, phase), n in self.computed_tokens.items() if phase == "prefill")

    @property
    def total_generated_tokens(self) -> int:
        return sum(self.generated_tokens.values())


@dataclass(frozen=True)
class TokenUpdate:
    """What one step did to one request that sampled a token."""

    request: Request
    sampled: SampledToken


@dataclass
class _PlanBuilder:
    """The step plan under construction; a preempted request can be taken back out."""

    budget: int
    # What batch work may still spend of ``budget`` this step.
    batch_budget: int
    new_requests: dict[str, NewRequest] = field(default_factory=dict)
    running: dict[str, RunningRequestDiff] = field(default_factory=dict)
    tokens: dict[str, int] = field(default_factory=dict)

    def budget_for(self, request: Request) -> int:
        return self.budget if request.interactive else min(self.budget, self.batch_budget)

    def add_new(self, request: Request, block_ids: list[int], num_tokens: int) -> None:
        self.new_requests[request.request_id] = NewRequest(
            request_id=request.request_id,
            prompt_token_ids=list(request.prompt_token_ids),
            output_token_ids=list(request.output_token_ids),
            sampling=request.sampling,
            block_ids=block_ids,
            num_computed_tokens=request.num_computed_tokens,
            images=request.images,
        )
        self._spend(request, num_tokens)

    def add_running(self, request: Request, new_block_ids: list[int], num_tokens: int) -> None:
        self.running[request.request_id] = RunningRequestDiff(
            request.request_id, new_block_ids, request.num_computed_tokens
        )
        self._spend(request, num_tokens)

    def drop(self, request: Request) -> None:
        tokens = self.tokens.pop(request.request_id, 0)
        self.budget += tokens
        if not request.interactive:
            self.batch_budget += tokens
        self.new_requests.pop(request.request_id, None)
        self.running.pop(request.request_id, None)

    def build(self, finished_request_ids: set[str], kv_moves: KvBlockMoves) -> StepPlan:
        return StepPlan(
            list(self.new_requests.values()),
            list(self.running.values()),
            self.tokens,
            finished_request_ids,
            kv_moves,
        )

    def _spend(self, request: Request, num_tokens: int) -> None:
        self.tokens[request.request_id] = num_tokens
        self.budget -= num_tokens
        if not request.interactive:
            self.batch_budget -= num_tokens


class Scheduler:
    """Owns every live request (waiting or running) and decides each step's work.

    Requests enter with ``add_request`` and leave when they finish
    (``update_from_step``, ``finish_request``) or are aborted (``abort``); either
    way their blocks are freed at once and their id is reported to the runner
    in the next plan's ``finished_request_ids``.
    """

    def __init__(self, kv: KVCacheManager, config: SchedulerConfig) -> None:
        self.kv = kv
        self.config = config
        self.waiting = WaitingQueue()
        self.running: list[Request] = []
        self._requests: dict[str, Request] = {}
        # Arrival order; breaks ties between equal arrival times when picking a victim.
        self._arrival_seq: dict[str, int] = {}
        self._counter = itertools.count()
        self._finished_ids: set[str] = set()
        # Interactive requests the last schedule() could not admit (no seat or KV room), ready
        # ones only: what says a replica has no slack to lend batch work. One that arrived
        # since is not counted: it joins the next step, as it would on an idle replica.
        self.num_interactive_left_waiting = 0
        self.counts = SchedulerCounts()
        # The engine reports each step's tokens and time here (EngineCore.step).
        self.step_cost = StepCostModel()
        # What the last schedule() capped batch work at beside interactive work (the gauge's value).
        self.last_batch_token_budget = self.batch_token_budget()

    # ---------------------------------------------------------------- requests

    def add_request(self, request: Request) -> None:
        """Queue a new request; InvalidRequest if it can never run, EngineOverloaded if the queue is full."""
        self._validate(request)
        if len(self.waiting) >= self.config.max_waiting:
            raise EngineOverloaded(f"{len(self.waiting)} requests already waiting")
        request.status = RequestStatus.WAITING
        self._requests[request.request_id] = request
        self._arrival_seq[request.request_id] = next(self._counter)
        self.waiting.push(request)

    def abort(self, request_id: str) -> Request:
        """Finish a waiting or running request as aborted, freeing its blocks now."""
        if request_id not in self._requests:
            raise RequestNotFound(request_id)
        return self.finish_request(request_id, RequestStatus.FINISHED_ABORTED)

    def finish_request(self, request_id: str, status: RequestStatus, stop_reason: str = "") -> Request:
        """End a live request with a terminal ``status``; frees its blocks."""
        assert status.is_finished, status
        request = self._requests.pop(request_id)
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        self.kv.free(request)
        request.status = status
        request.stop_reason = stop_reason
        self.counts.finished_requests[status.name] += 1
        self._arrival_seq.pop(request_id)
        self._finished_ids.add(request_id)
        return request

    def get_request(self, request_id: str) -> Request | None:
        return self._requests.get(request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    def _validate(self, request: Request) -> None:
        rid = request.request_id
        if rid in self._requests:
            raise InvalidRequest(f"request id {rid!r} is already in use")
        if not request.prompt_token_ids:
            raise InvalidRequest("the prompt is empty")
        # In-process callers (tests, benches, replay) skip the servicer: the same rules again.
        check_value("max_tokens", request.max_tokens)
        check_context_window(request.num_prompt_tokens, None, self.config.max_model_len, model=self.kv.model)
        # The last sampled token is never computed, so KV is needed for one token less.
        max_len = min(request.num_prompt_tokens + request.max_tokens, self.config.max_model_len)
        if not self.kv.can_ever_fit(max_len - 1):
            raise InvalidRequest(f"{max_len} tokens can never fit in {self.kv.num_blocks} KV blocks")

    # ---------------------------------------------------------------- schedule

    def schedule(self) -> StepPlan:
        """Spend this step's token budget: running requests first, then waiting ones.

        Finished ids are handed to the runner only with a plan that has work, so
        a caller may skip the runner on an empty plan without losing them. The
        runner drops ``finished_request_ids`` before it adds ``new_requests``.
        """
        budget = self.config.max_num_batched_tokens
        # The cap protects interactive traffic; with none about, batch work takes whole steps.
        interactive = self.waiting.num_interactive or any(r.interactive for r in self.running)
        self.last_batch_token_budget = self.batch_token_budget()
        plan = _PlanBuilder(budget, batch_budget=self.last_batch_token_budget if interactive else budget)
        num_running = len(self.running)
        hold_batch = self._interactive_can_start()
        self._schedule_running(plan, hold_batch=hold_batch)
        # After a preemption blocks are short: admitting more would only thrash
        # (and could resume the victim in the very plan that drops it).
        if len(self.running) == num_running:
            self._schedule_waiting(plan, admit_batch=not hold_batch)
        self.num_interactive_left_waiting = sum(
            1 for request in self.waiting.interactive_requests() if request.is_ready
        )
        moves = self.kv.take_block_moves()
        if not plan.tokens and not moves:
            return StepPlan()
        finished, self._finished_ids = self._finished_ids, set()
        return plan.build(finished, moves)

    def batch_token_budget(self) -> int:
        """Most tokens of batch work in a step while interactive requests are about (at least
        one, so a backlog always moves)."""
        config = self.config
        if config.max_batch_tokens_per_step is not None:
            return config.max_batch_tokens_per_step
        cost = self.step_cost.estimate()
        if cost is None:
            return max(config.max_num_batched_tokens // 4, 1)
        allowed = cost.tokens_within(
            config.batch_step_allowance * cost.fixed_seconds, config.max_num_batched_tokens
        )
        return max(allowed, 1)

    def _interactive_can_start(self) -> bool:
        """True when the next request to admit is interactive and a seat and blocks await it.

        Its first step then carries no batch prompt work: the backlog's prompt chunks beside
        a new interactive prefill would make its first token wait for them (the async
        queue's promise is that interactive traffic keeps its latency). Batch decodes stay:
        a token each, and holding them cost the backlog a step per interactive arrival
        (its drain fell to 0.6-0.75 of the free capacity in ``make bench``; 0.93 with
        them). Batch prompts resume the step after. Only when the request surely fits
        (free blocks for its whole prompt, hits not counted), so held batch requests never
        keep blocks it needs.
        """
        if len(self.running) >= self.config.max_num_seqs and self._newest_batch_request() is None:
            return False
        request = self.waiting.peek_ready()
        if request is None or not request.interactive:
            return False
        return self.kv.num_free_blocks >= cdiv(request.num_tokens, self.kv.block_size)

    def _schedule_running(self, plan: _PlanBuilder, *, hold_batch: bool) -> None:
        """Give each running request its tokens, decoding ones first (sorted is stable)."""
        for request in sorted(self.running, key=self._is_prefilling):
            if request.status != RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            if hold_batch and not request.interactive and self._is_prefilling(request):
                continue
            num_tokens = min(request.num_tokens - request.num_computed_tokens, plan.budget_for(request))
            if num_tokens <= 0:
                continue
            new_blocks = self._allocate_or_preempt(request, num_tokens, plan)
            if new_blocks is not None:
                plan.add_running(request, new_blocks, num_tokens)

    def _allocate_or_preempt(self, request: Request, num_tokens: int, plan: _PlanBuilder) -> list[int] | None:
        """Allocate blocks for ``request``, preempting victims until it fits; None if it was the victim."""
        while (new_blocks := self.kv.allocate_slots(request, num_tokens)) is None:
            victim = self._pick_victim()
            self._preempt(victim, plan, reason="kv_cache")
            if victim is request:
                return None
        return new_blocks

    def _schedule_waiting(self, plan: _PlanBuilder, *, admit_batch: bool) -> None:
        """Admit waiting requests in queue order while budget, seats and blocks last.

        Requests not ready yet (grammar still compiling) are passed over, not waited for."""
        while plan.budget > 0:
            request = self.waiting.peek_ready()
            if request is None or (not admit_batch and not request.interactive):
                return
            if not request.interactive and not self._batch_seat_free():
                return  # interactive requests queue ahead of batch ones: none is left to admit
            if len(self.running) >= self.config.max_num_seqs:
                seat_holder = self._newest_batch_request() if request.interactive else None
                if seat_holder is None:
                    return
                self._preempt(seat_holder, plan, reason="seat")
            if not self._start_waiting(request, plan):
                # Batch work has spent its share (interactive requests queue ahead of it), or
                # blocks are short: keep queue order rather than let others pass.
                return

    def _start_waiting(self, request: Request, plan: _PlanBuilder) -> bool:
        """Admit ``request`` with what the plan's budget holds, prefix hits first; False (and
        nothing changed) when the budget or the free blocks cannot take it."""
        hits, num_hit_tokens = self.kv.get_computed_blocks(request, self._computed_requests(plan))
        num_tokens = min(request.num_tokens - num_hit_tokens, plan.budget_for(request))
        if num_tokens <= 0 or self.kv.allocate_slots(request, num_tokens, hits) is None:
            return False
        self.waiting.remove(request)
        self._admit(request, num_hit_tokens)
        plan.add_new(request, self.kv.block_ids(request.request_id), num_tokens)
        return True

    def _computed_requests(self, plan: _PlanBuilder) -> Iterator[Request]:
        """Running requests whose computed tokens' KV is in their blocks already, which a new
        request may copy from: not those this plan admits (their hits from the host tier, or
        copied from others, are filled in only when the runner carries out the plan)."""
        return (request for request in self.running if request.request_id not in plan.new_requests)

    def _batch_seat_free(self) -> bool:
        limit = self.config.max_batch_running
        return limit is None or len(self.running) < limit

    def _admit(self, request: Request, num_hit_tokens: int) -> None:
        if not request.timeline.admitted_ns:
            request.timeline.admitted_ns = time.time_ns()
        request.status = RequestStatus.RUNNING
        request.num_computed_tokens = num_hit_tokens
        if request.num_cached_tokens < 0:
            # Billing reports the hits of the first admission only.
            request.num_cached_tokens = num_hit_tokens
        self.running.append(request)

    def _newest_batch_request(self) -> Request | None:
        """The running batch request that gives up its seat to an interactive one: the victim a
        dry KV pool would pick, when that is batch work."""
        if not self.running:
            return None
        victim = self._pick_victim()
        return None if victim.interactive else victim

    def _pick_victim(self) -> Request:
        """Batch work before interactive work, then the most recent arrival."""
        return max(
            self.running,
            key=lambda r: (not r.interactive, r.arrival_time, self._arrival_seq[r.request_id]),
        )

    def _preempt(self, request: Request, plan: _PlanBuilder, *, reason: str) -> None:
        """Free the request's blocks and send it to the front of the waiting queue."""
        self.counts.preemptions[reason] += 1
        plan.drop(request)
        self.running.remove(request)
        self.kv.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        self.waiting.push_front(request)
        # The runner drops its state; the request comes back as a NewRequest.
        self._finished_ids.add(request.request_id)

    @staticmethod
    def _is_prefilling(request: Request) -> bool:
        return request.num_tokens - request.num_computed_tokens > 1

    # ------------------------------------------------------------------ update

    def update_from_step(
        self, plan: StepPlan, result: StepResult, matched_stops: dict[str, str] | None = None
    ) -> list[TokenUpdate]:
        """Advance computed tokens, append sampled tokens, and finish requests that are done.

        ``matched_stops`` maps request id -> stop string that the caller's text
        check found in the token sampled this step ("" when the request's
        grammar completed: it stops without a stop string). Requests that ended while
        the step ran (aborted) are skipped.
        """
        updates: list[TokenUpdate] = []
        counts = self.counts
        if plan.num_scheduled_tokens:
            counts.steps += 1
            counts.scheduled_requests += len(plan.num_scheduled_tokens)
        for request_id, num_tokens in plan.num_scheduled_tokens.items():
            request = self._requests.get(request_id)
            if request is None or request.status != RequestStatus.RUNNING:
                continue
            priority = priority_of(request)
            # Only the newest token's KV is left to compute: this request is generating.
            decoding = (
                bool(request.output_token_ids) and request.num_computed_tokens == request.num_tokens - 1
            )
            counts.computed_tokens[priority, "decode" if decoding else "prefill"] += num_tokens
            request.timeline.prefill_chunks += not decoding
            request.num_computed_tokens += num_tokens
            self.kv.cache_computed_blocks(request)
            sampled = result.sampled.get(request_id)
            if sampled is None:
                continue  # a prefill chunk that stopped mid-prompt
            if request.num_computed_tokens != request.num_tokens:
                raise RuntimeError(f"runner sampled for {request_id} before its last token")
            request.output_token_ids.append(sampled.token_id)
            if not request.timeline.first_token_ns:
                request.timeline.first_token_ns = time.time_ns()
            counts.generated_tokens[priority] += 1
            self._maybe_finish(request, (matched_stops or {}).get(request_id))
            updates.append(TokenUpdate(request, sampled))
        return updates

    def _maybe_finish(self, request: Request, matched_stop: str | None) -> None:
        token = request.output_token_ids[-1]
        sampling = request.sampling
        eos = () if sampling.ignore_eos else (*self.config.eos_token_ids, *sampling.extra_stop_token_ids)
        if token in sampling.stop_token_ids or token in eos or matched_stop is not None:
            # A stop token whose text also completes a stop string still names it: the router cuts
            # the text there (it matches none itself).
            self.finish_request(request.request_id, RequestStatus.FINISHED_STOPPED, matched_stop or "")
        elif (
            len(request.output_token_ids) >= request.max_tokens
            or request.num_tokens >= self.config.max_model_len
        ):
            self.finish_request(request.request_id, RequestStatus.FINISHED_LENGTH)

    # ------------------------------------------------------------------- stats

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def check_invariants(self) -> None:
        """KV invariants plus: every live request is in exactly one of waiting/running,
        with a status to match, and waiting requests hold no blocks."""
        self.kv.check_invariants(self.running)
        running_ids = [r.request_id for r in self.running]
        waiting_ids = [r.request_id for r in self.waiting]
        assert len(set(running_ids)) == len(running_ids), f"running twice: {running_ids}"
        assert set(running_ids).isdisjoint(waiting_ids), "a request is both running and waiting"
        assert set(running_ids) | set(waiting_ids) == set(self._requests), "live requests lost or leaked"
        assert len(self.running) <= self.config.max_num_seqs, "too many running requests"
        self._check_statuses(self.running, (RequestStatus.RUNNING,))
        self._check_statuses(self.waiting, (RequestStatus.WAITING, RequestStatus.PREEMPTED))
        for request in self.waiting:
            assert not self.kv.block_ids(request.request_id), f"waiting {request.request_id} holds blocks"

    @staticmethod
    def _check_statuses(requests: Iterable[Request], allowed: tuple[RequestStatus, ...]) -> None:
        for request in requests:
            assert request.status in allowed, f"{request.request_id} is {request.status.name}"
