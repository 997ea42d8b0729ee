"""Scheduler: token budget, chunked prefill, priorities, limits, preemption, finishing.

The runner here is ``SimulatedRunner``: it follows the step plans the way a
model runner must (new requests, diffs, drops), writes token ids into
simulated KV slots so that every prefix-cache hit is checked against the
tokens it claims to hold, and samples from ``next_token``, a plain function of
a request's token history (test data), so any schedule gives the same text.
"""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass, field

import pytest
from test_block_pool import replay

from cachet.engine.block_pool import BlockPool
from cachet.engine.errors import EngineOverloaded, RequestNotFound
from cachet.engine.kv_cache_manager import KVCacheManager
from cachet.engine.request import Request, RequestStatus
from cachet.engine.sampling_params import SamplingParams
from cachet.engine.scheduler import Scheduler, SchedulerConfig
from cachet.engine.step_plan import SampledToken, StepPlan, StepResult
from cachet.errors import InvalidArgument

BS = 4
EOS = 0


def next_token(tokens: list[int]) -> int:
    """Deterministic 'model': the next token id from the history (never EOS)."""
    return (tokens[-1] * 7 + len(tokens) * 3 + tokens[0]) % 50 + 1


def reference_output(prompt: list[int], num_tokens: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(num_tokens):
        tokens.append(next_token(tokens))
    return tokens[len(prompt) :]


@dataclass
class _Seq:
    tokens: list[int]
    blocks: list[int]
    computed: int


@dataclass
class SimulatedRunner:
    """Follows step plans like a model runner, with token ids as its 'KV'."""

    num_kv_blocks: int
    block_size: int = BS
    seqs: dict[str, _Seq] = field(default_factory=dict)
    slots: dict[int, list[int | None]] = field(default_factory=dict)
    plans: list[StepPlan] = field(default_factory=list)

    def execute(self, plan: StepPlan) -> StepResult:
        self.plans.append(plan)
        for request_id in plan.finished_request_ids:
            self.seqs.pop(request_id, None)
        for new in plan.new_requests:
            assert new.request_id not in self.seqs, f"{new.request_id} sent twice"
            seq = _Seq(
                new.prompt_token_ids + new.output_token_ids, list(new.block_ids), new.num_computed_tokens
            )
            self.seqs[new.request_id] = seq
        for diff in plan.running:
            seq = self.seqs[diff.request_id]
            assert diff.num_computed_tokens == seq.computed, f"{diff.request_id}: computed count drifted"
            seq.blocks += diff.new_block_ids
        for source, destination in plan.kv_moves.duplicate:
            self.slots[destination] = list(self._slot_row(source))
        sampled = {}
        for request_id, num_tokens in plan.num_scheduled_tokens.items():
            seq = self.seqs[request_id]
            self._check_kv(request_id, seq)
            assert num_tokens >= 1 and seq.computed + num_tokens <= len(seq.tokens)
            assert len(seq.blocks) * self.block_size >= seq.computed + num_tokens, f"{request_id}: no room"
            for pos in range(seq.computed, seq.computed + num_tokens):
                self._slot_row(seq.blocks[pos // self.block_size])[pos % self.block_size] = seq.tokens[pos]
            seq.computed += num_tokens
            if seq.computed == len(seq.tokens):
                seq.tokens.append(next_token(seq.tokens))
                sampled[request_id] = SampledToken(seq.tokens[-1])
        return StepResult(sampled)

    def _slot_row(self, block_id: int) -> list[int | None]:
        return self.slots.setdefault(block_id, [None] * self.block_size)

    def _check_kv(self, request_id: str, seq: _Seq) -> None:
        """Every computed position (cache hits included) holds this request's token."""
        for pos in range(seq.computed):
            held = self._slot_row(seq.blocks[pos // self.block_size])[pos % self.block_size]
            assert held == seq.tokens[pos], (
                f"{request_id}: KV at position {pos} is {held}, not {seq.tokens[pos]}"
            )


def make_scheduler(num_blocks: int = 64, **config) -> tuple[Scheduler, SimulatedRunner]:
    config.setdefault("max_model_len", 256)
    config.setdefault("eos_token_ids", (EOS,))
    kv = KVCacheManager(BlockPool(num_blocks), model="tiny", block_size=BS)
    return Scheduler(kv, SchedulerConfig(**config)), SimulatedRunner(num_blocks)


def make_request(
    request_id: str, prompt: list[int], max_tokens: int = 8, *, interactive: bool = True, **sampling
) -> Request:
    return Request(request_id, list(prompt), SamplingParams(**sampling), max_tokens, interactive=interactive)


def step(scheduler: Scheduler, runner: SimulatedRunner) -> StepPlan:
    plan = scheduler.schedule()
    if not plan.is_empty:
        scheduler.update_from_step(plan, runner.execute(plan))
    scheduler.check_invariants()
    return plan


def run_to_completion(scheduler: Scheduler, runner: SimulatedRunner, max_steps: int = 10_000) -> None:
    for _ in range(max_steps):
        if not scheduler.has_unfinished_requests():
            return
        step(scheduler, runner)
    raise AssertionError("scheduler made no progress")


# ------------------------------------------------------------------ budget


def test_chunked_prefill_respects_the_budget():
    scheduler, runner = make_scheduler(max_num_batched_tokens=8, max_num_seqs=2)
    request = make_request("a", list(range(1, 21)), max_tokens=2)
    scheduler.add_request(request)
    chunks = [step(scheduler, runner).num_scheduled_tokens for _ in range(4)]
    assert chunks == [{"a": 8}, {"a": 8}, {"a": 4}, {"a": 1}]
    assert request.output_token_ids == reference_output(list(range(1, 21)), 2)
    assert request.status == RequestStatus.FINISHED_LENGTH


def test_decoding_requests_are_never_starved_by_a_long_prompt():
    scheduler, runner = make_scheduler(max_num_batched_tokens=8, max_num_seqs=4)
    decoder = make_request("decoder", [5, 6, 7], max_tokens=20)
    scheduler.add_request(decoder)
    step(scheduler, runner)
    scheduler.add_request(make_request("long", list(range(1, 61)), max_tokens=1))
    for _ in range(6):
        plan = step(scheduler, runner)
        assert plan.num_scheduled_tokens == {"decoder": 1, "long": 7}
        assert plan.total_scheduled_tokens <= 8


def test_max_num_seqs_caps_the_batch():
    scheduler, runner = make_scheduler(max_num_seqs=2)
    for i in range(3):
        scheduler.add_request(make_request(f"r{i}", [i + 1] * 5))
    plan = step(scheduler, runner)
    assert set(plan.num_scheduled_tokens) == {"r0", "r1"}
    assert scheduler.num_running == 2 and scheduler.num_waiting == 1


def test_config_rejects_a_budget_smaller_than_the_batch():
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        SchedulerConfig(max_model_len=64, max_num_batched_tokens=8, max_num_seqs=16)


# --------------------------------------------------------------- admission


def test_full_waiting_queue_raises_engine_overloaded():
    scheduler, _ = make_scheduler(max_waiting=2)
    scheduler.add_request(make_request("a", [1]))
    scheduler.add_request(make_request("b", [1]))
    with pytest.raises(EngineOverloaded):
        scheduler.add_request(make_request("c", [1]))
    assert scheduler.get_request("c") is None
    scheduler.check_invariants()


@pytest.mark.parametrize(
    ("request_", "message"),
    [
        (make_request("a", [1]), "already in use"),
        (make_request("b", []), "empty"),
        (make_request("c", [1] * 64), "context window"),
        (make_request("d", [1], max_tokens=0), "max_tokens"),
        # 20 + 13 tokens need KV for 32 = 8 blocks; the pool has 8: fits. 14 would not.
        (make_request("e", [1] * 20, max_tokens=14), "can never fit"),
    ],
)
def test_invalid_requests_are_rejected_up_front(request_, message):
    scheduler, _ = make_scheduler(num_blocks=8, max_model_len=64, max_num_seqs=4, max_num_batched_tokens=8)
    scheduler.add_request(make_request("a", [1]))
    # InvalidArgument: the window and max_tokens rules are cachet.sampling_ranges' (InvalidRequest's base).
    with pytest.raises(InvalidArgument, match=message):
        scheduler.add_request(request_)
    scheduler.add_request(make_request("fits", [1] * 20, max_tokens=13))


def test_interactive_requests_go_before_batch_ones():
    scheduler, runner = make_scheduler(max_num_seqs=1)
    scheduler.add_request(make_request("batch", [1, 2], max_tokens=1, interactive=False))
    scheduler.add_request(make_request("chat", [3, 4], max_tokens=1))
    assert set(step(scheduler, runner).num_scheduled_tokens) == {"chat"}
    assert set(step(scheduler, runner).num_scheduled_tokens) == {"batch"}


def test_a_starting_interactive_request_gets_a_step_without_batch_prompt_work():
    # A budget of 16 tokens a step, of which batch work may spend 4 beside interactive work.
    scheduler, runner = make_scheduler(max_num_seqs=4, max_num_batched_tokens=16)
    decoding = make_request("decoding", [1, 2, 3], max_tokens=8, interactive=False)
    scheduler.add_request(decoding)
    step(scheduler, runner)
    long = make_request("long", list(range(10, 50)), max_tokens=4, interactive=False)
    scheduler.add_request(long)
    assert step(scheduler, runner).num_scheduled_tokens == {"decoding": 1, "long": 15}
    scheduler.add_request(make_request("chat", [4, 5, 6], max_tokens=8))
    # Batch decodes (a token each) stay; the batch prompt chunk waits one step.
    assert step(scheduler, runner).num_scheduled_tokens == {"chat": 3, "decoding": 1}
    assert step(scheduler, runner).num_scheduled_tokens == {"chat": 1, "decoding": 1, "long": 3}
    run_to_completion(scheduler, runner)
    assert decoding.output_token_ids == reference_output([1, 2, 3], 8)
    assert long.output_token_ids == reference_output(list(range(10, 50)), 4)


def test_batch_work_spends_at_most_its_share_of_a_step_beside_interactive_work():
    # Alone, batch work takes whole steps.
    scheduler, runner = make_scheduler(max_num_seqs=4, max_num_batched_tokens=8, max_batch_tokens_per_step=2)
    scheduler.add_request(make_request("batch", list(range(1, 13)), max_tokens=2, interactive=False))
    assert step(scheduler, runner).num_scheduled_tokens == {"batch": 8}
    # Beside interactive work it gets its share; interactive work may spend the whole budget.
    scheduler, runner = make_scheduler(max_num_seqs=4, max_num_batched_tokens=16)
    scheduler.add_request(make_request("batch", list(range(1, 13)), max_tokens=2, interactive=False))
    scheduler.add_request(make_request("chat", list(range(20, 32)), max_tokens=2))
    assert step(scheduler, runner).num_scheduled_tokens == {"chat": 12}  # the chat's first step
    assert step(scheduler, runner).num_scheduled_tokens == {"chat": 1, "batch": 4}
    run_to_completion(scheduler, runner)


def _fit_step_costs(scheduler: Scheduler, fixed: float, per_token: float) -> None:
    for tokens in itertools.islice(itertools.cycle((1, 4, 16, 64)), 64):
        scheduler.step_cost.observe(tokens, fixed + per_token * tokens)


def test_batch_work_beside_interactive_work_gets_what_the_step_costs_measured_allow():
    # A CPU's steps: 30 ms fixed, 2 ms a token; 1.5 fixed costs are 22 tokens (not a quarter's 16).
    scheduler, runner = make_scheduler(
        num_blocks=256, max_num_seqs=4, max_num_batched_tokens=64, batch_step_allowance=1.5
    )
    _fit_step_costs(scheduler, 0.030, 0.002)
    assert scheduler.batch_token_budget() == 22
    scheduler.add_request(make_request("batch", list(range(1, 41)), max_tokens=2, interactive=False))
    scheduler.add_request(make_request("chat", list(range(50, 54)), max_tokens=4))
    assert step(scheduler, runner).num_scheduled_tokens == {"chat": 4}
    assert step(scheduler, runner).num_scheduled_tokens == {"chat": 1, "batch": 22}
    # A GPU's: tokens add nothing measurable, so batch work takes what the step has left (at the
    # default allowance).
    scheduler, runner = make_scheduler(num_blocks=256, max_num_seqs=4, max_num_batched_tokens=64)
    _fit_step_costs(scheduler, 0.020, 0.0)
    assert scheduler.batch_token_budget() == 64
    scheduler.add_request(make_request("batch", list(range(1, 81)), max_tokens=2, interactive=False))
    scheduler.add_request(make_request("chat", list(range(90, 94)), max_tokens=4))
    step(scheduler, runner)
    assert step(scheduler, runner).num_scheduled_tokens == {"chat": 1, "batch": 63}
    # A budget set outright wins, and a smaller allowance gives less.
    scheduler, _ = make_scheduler(max_num_batched_tokens=64, max_batch_tokens_per_step=5)
    _fit_step_costs(scheduler, 0.030, 0.002)
    assert scheduler.batch_token_budget() == 5
    scheduler, _ = make_scheduler(max_num_batched_tokens=64, batch_step_allowance=0.5)
    _fit_step_costs(scheduler, 0.030, 0.002)
    assert scheduler.batch_token_budget() == 7


def test_batch_step_allowance_must_be_positive():
    with pytest.raises(ValueError, match="batch_step_allowance"):
        SchedulerConfig(max_model_len=64, batch_step_allowance=0)


def test_an_interactive_request_takes_the_seat_of_the_newest_batch_request():
    scheduler, runner = make_scheduler(max_num_seqs=2)
    older = make_request("older", [1, 2, 3], max_tokens=6, interactive=False)
    newer = make_request("newer", [7, 8, 9], max_tokens=6, interactive=False)
    scheduler.add_request(older)
    scheduler.add_request(newer)
    step(scheduler, runner)
    step(scheduler, runner)
    scheduler.add_request(make_request("chat", [4, 5, 6], max_tokens=4))
    plan = step(scheduler, runner)
    assert set(plan.num_scheduled_tokens) == {"older", "chat"}
    assert "newer" in plan.finished_request_ids and newer.status == RequestStatus.PREEMPTED
    assert scheduler.counts.preemptions == {"kv_cache": 0, "seat": 1}
    run_to_completion(scheduler, runner)
    # The preempted request resumed where it was, recomputing what it had lost.
    assert newer.output_token_ids == reference_output([7, 8, 9], 6)
    assert older.output_token_ids == reference_output([1, 2, 3], 6)


def test_interactive_requests_wait_for_a_seat_only_behind_interactive_ones():
    scheduler, runner = make_scheduler(max_num_seqs=1)
    scheduler.add_request(make_request("first-chat", [1, 2, 3], max_tokens=4))
    step(scheduler, runner)
    scheduler.add_request(make_request("second-chat", [4, 5, 6], max_tokens=4))
    plan = step(scheduler, runner)
    assert set(plan.num_scheduled_tokens) == {"first-chat"} and not plan.finished_request_ids
    run_to_completion(scheduler, runner)


def test_only_interactive_requests_a_step_could_not_admit_count_as_left_waiting():
    scheduler, runner = make_scheduler(max_num_seqs=1)
    scheduler.add_request(make_request("first-chat", [1, 2, 3], max_tokens=4))
    scheduler.add_request(make_request("batch", [7, 8, 9], max_tokens=4, interactive=False))
    assert scheduler.num_interactive_left_waiting == 0  # nothing scheduled yet
    step(scheduler, runner)
    assert scheduler.num_interactive_left_waiting == 0  # the chat got the seat, the batch waits
    scheduler.add_request(make_request("second-chat", [4, 5, 6], max_tokens=4))
    assert scheduler.num_interactive_left_waiting == 0  # arrived after the step
    step(scheduler, runner)
    assert scheduler.num_interactive_left_waiting == 1  # no seat: the first chat holds it
    run_to_completion(scheduler, runner)
    assert scheduler.num_interactive_left_waiting == 0


def test_batch_work_is_not_held_for_an_interactive_request_that_cannot_start():
    # No free blocks for its prompt: the batch request holds them and must finish to free them.
    scheduler, runner = make_scheduler(num_blocks=3, max_num_seqs=2)
    scheduler.add_request(make_request("batch", list(range(1, 2 * BS + 1)), max_tokens=4, interactive=False))
    step(scheduler, runner)
    scheduler.add_request(make_request("chat", list(range(60, 60 + 2 * BS)), max_tokens=4))
    assert "batch" in step(scheduler, runner).num_scheduled_tokens
    run_to_completion(scheduler, runner)


# ----------------------------------------------------------------- caching


def test_cached_tokens_are_reported_when_first_scheduled():
    scheduler, runner = make_scheduler()
    prompt = list(range(1, 15))  # 14 tokens: 3 full blocks
    first = make_request("first", prompt, max_tokens=1)
    scheduler.add_request(first)
    run_to_completion(scheduler, runner)
    assert first.num_cached_tokens == 0
    second = make_request("second", prompt, max_tokens=1)
    scheduler.add_request(second)
    plan = step(scheduler, runner)
    assert second.num_cached_tokens == 12
    assert plan.new_requests[0].num_computed_tokens == 12
    assert plan.num_scheduled_tokens == {"second": 2}


# -------------------------------------------------------------- preemption


def test_preemption_frees_the_newest_and_it_resumes_with_the_same_tokens():
    # 6 blocks of 4: each request's prompt takes 2 blocks, and growth needs more.
    scheduler, runner = make_scheduler(num_blocks=6, max_num_batched_tokens=16, max_num_seqs=4)
    old = make_request("old", [1, 2, 3, 4, 5, 6, 7], max_tokens=10)
    new = make_request("new", [9, 8, 7, 6, 5, 4, 3], max_tokens=10)
    scheduler.add_request(old)
    scheduler.add_request(new)
    preempted_in: list[StepPlan] = []
    while scheduler.has_unfinished_requests():
        plan = step(scheduler, runner)
        if "new" in plan.finished_request_ids and not new.is_finished:
            preempted_in.append(plan)
            assert new.status == RequestStatus.PREEMPTED
            assert scheduler.waiting.peek() is new
            assert scheduler.kv.block_ids("new") == []
            # Blocks are short: nothing is admitted in the step that preempts.
            assert not plan.new_requests
    assert preempted_in, "the pool was meant to run dry"
    assert scheduler.counts.preemptions == {"kv_cache": len(preempted_in), "seat": 0}
    resumed = [p for p in runner.plans if any(n.request_id == "new" for n in p.new_requests)][1:]
    assert resumed and resumed[0].new_requests[0].output_token_ids, "resumed with its output tokens"
    assert old.output_token_ids == reference_output(old.prompt_token_ids, 10)
    assert new.output_token_ids == reference_output(new.prompt_token_ids, 10)
    assert new.num_cached_tokens == 0  # fixed at first admission
    assert scheduler.kv.num_free_blocks == 6


def test_batch_work_is_preempted_before_interactive_work():
    scheduler, runner = make_scheduler(num_blocks=4, max_num_seqs=2)
    scheduler.add_request(make_request("batch", [1, 2, 3], max_tokens=8, interactive=False))
    step(scheduler, runner)
    scheduler.add_request(make_request("chat", [4, 5, 6], max_tokens=8))
    first_preempted = None
    while scheduler.has_unfinished_requests() and first_preempted is None:
        plan = step(scheduler, runner)
        live = [r for r in plan.finished_request_ids if scheduler.get_request(r)]
        first_preempted = live[0] if live else None
    assert first_preempted == "batch"


# -------------------------------------------------------------- finishing


@pytest.mark.parametrize(
    ("sampling", "max_tokens", "expected_len", "status"),
    [
        ({}, 5, 5, RequestStatus.FINISHED_LENGTH),
        ({"stop_token_ids": (None,)}, 20, 3, RequestStatus.FINISHED_STOPPED),  # the 3rd token
        ({"extra_stop_token_ids": (None,)}, 20, 3, RequestStatus.FINISHED_STOPPED),
        ({"extra_stop_token_ids": (None,), "ignore_eos": True}, 20, 20, RequestStatus.FINISHED_LENGTH),
    ],
)
def test_finish_conditions(sampling, max_tokens, expected_len, status):
    prompt = [3, 1, 4]
    third = reference_output(prompt, 3)[2]
    sampling = {
        k: tuple(third if t is None else t for t in v) if isinstance(v, tuple) else v
        for k, v in sampling.items()
    }
    scheduler, runner = make_scheduler()
    request = make_request("a", prompt, max_tokens, **sampling)
    scheduler.add_request(request)
    run_to_completion(scheduler, runner)
    assert len(request.output_token_ids) == expected_len
    assert request.status == status


def test_eos_stops_unless_ignored():
    for ignore_eos, expected in (
        (False, RequestStatus.FINISHED_STOPPED),
        (True, RequestStatus.FINISHED_LENGTH),
    ):
        scheduler, runner = make_scheduler(eos_token_ids=(reference_output([2, 7], 2)[1],))
        request = make_request("a", [2, 7], 6, ignore_eos=ignore_eos)
        scheduler.add_request(request)
        run_to_completion(scheduler, runner)
        assert request.status == expected
        assert len(request.output_token_ids) == (2 if not ignore_eos else 6)


def test_context_window_ends_generation():
    scheduler, runner = make_scheduler(max_model_len=10, max_num_batched_tokens=8, max_num_seqs=2)
    request = make_request("a", [1] * 7, max_tokens=100)
    scheduler.add_request(request)
    run_to_completion(scheduler, runner)
    assert request.num_tokens == 10 and request.status == RequestStatus.FINISHED_LENGTH


def test_matched_stop_string_finishes_with_its_reason():
    scheduler, runner = make_scheduler()
    request = make_request("a", [1, 2], 10)
    scheduler.add_request(request)
    plan = scheduler.schedule()
    [update] = scheduler.update_from_step(plan, runner.execute(plan), {"a": "###"})
    assert update.request is request
    assert request.status == RequestStatus.FINISHED_STOPPED and request.stop_reason == "###"
    assert scheduler.schedule().is_empty
    scheduler.add_request(make_request("b", [1, 2], 1))
    # The finished id travels with the next plan that has work.
    assert scheduler.schedule().finished_request_ids == {"a"}


def test_a_stop_token_that_completes_a_stop_string_still_names_it():
    # The router cuts the text only where the engine names a stop string (it matches none itself).
    first = reference_output([1, 2], 1)[0]
    scheduler, runner = make_scheduler()
    request = make_request("a", [1, 2], 10, stop_token_ids=(first,))
    scheduler.add_request(request)
    plan = scheduler.schedule()
    scheduler.update_from_step(plan, runner.execute(plan), {"a": "###"})
    assert request.status == RequestStatus.FINISHED_STOPPED and request.stop_reason == "###"


def test_abort_frees_blocks_at_once_and_unknown_ids_raise():
    scheduler, runner = make_scheduler(num_blocks=8)
    scheduler.add_request(make_request("running", [1] * 9, 10))
    step(scheduler, runner)
    scheduler.add_request(make_request("waiting", [2] * 9, 10))
    assert scheduler.kv.block_ids("running")
    aborted = scheduler.abort("running")
    assert aborted.status == RequestStatus.FINISHED_ABORTED
    assert scheduler.kv.block_ids("running") == [] and scheduler.kv.num_free_blocks == 8
    scheduler.abort("waiting")
    scheduler.check_invariants()
    with pytest.raises(RequestNotFound):
        scheduler.abort("running")
    assert not scheduler.has_unfinished_requests()


# ------------------------------------------------------------------ random


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_random_traffic_with_aborts_and_preemptions(seed):
    rng = random.Random(seed)
    num_blocks = 20
    scheduler, runner = make_scheduler(
        num_blocks=num_blocks, max_model_len=64, max_num_batched_tokens=12, max_num_seqs=5, max_waiting=8
    )
    stems = [[rng.randrange(1, 50) for _ in range(16)] for _ in range(3)]
    requests: list[Request] = []
    known: set[int] = set()
    aborted = preempted = overloaded = 0
    for i in range(400):
        # Arrivals come in bursts, so the waiting queue sometimes overflows.
        for j in range(rng.choice([0, 0, 0, 1, 1, 4]) if i < 300 else 0):
            prompt = rng.choice(stems)[: rng.randint(1, 16)] + [
                rng.randrange(1, 50) for _ in range(rng.randint(0, 10))
            ]
            request = make_request(f"r{i}.{j}", prompt, rng.randint(1, 16), interactive=rng.random() < 0.6)
            try:
                scheduler.add_request(request)
                requests.append(request)
            except EngineOverloaded:
                overloaded += 1
        live = [r for r in requests if not r.is_finished]
        if live and rng.random() < 0.05:
            scheduler.abort(rng.choice(live).request_id)
            aborted += 1
        plan = step(scheduler, runner)
        preempted += sum(1 for r in plan.finished_request_ids if scheduler.get_request(r))
        assert plan.total_scheduled_tokens <= 12
        replay(scheduler.kv.take_events(), known)
        assert known == scheduler.kv.pool.cached_hashes()
    run_to_completion(scheduler, runner)
    replay(scheduler.kv.take_events(), known)
    assert known == scheduler.kv.pool.cached_hashes()
    assert all(scheduler.kv.pool.ref_count(b) == 0 for b in range(num_blocks))
    assert scheduler.kv.num_free_blocks == num_blocks
    for request in requests:
        assert request.is_finished
        expected = reference_output(request.prompt_token_ids, len(request.output_token_ids))
        assert request.output_token_ids == expected, request.request_id
        if request.status != RequestStatus.FINISHED_ABORTED:
            assert len(request.output_token_ids) == request.max_tokens
    assert preempted > 0 and aborted > 0 and overloaded > 0
    assert any(r.num_cached_tokens > 0 for r in requests)
    # The metrics' totals agree with what happened: each token sampled once (recompute
    # samples nothing), every model token counted, every preemption and ending counted.
    counts = scheduler.counts
    assert counts.total_generated_tokens == sum(len(r.output_token_ids) for r in requests)
    assert sum(counts.computed_tokens.values()) == sum(p.total_scheduled_tokens for p in runner.plans)
    assert counts.steps == len(runner.plans)
    assert counts.scheduled_requests == sum(len(p.num_scheduled_tokens) for p in runner.plans)
    assert sum(counts.preemptions.values()) >= preempted
    assert counts.finished_requests["FINISHED_ABORTED"] == aborted
    assert sum(counts.finished_requests.values()) == len(requests)


def test_batch_work_starts_only_below_its_seat_limit_and_waits_there_for_the_next_seat():
    scheduler, runner = make_scheduler(max_num_seqs=4, max_batch_running=2, max_num_batched_tokens=64)
    for i in range(3):
        prompt = list(range(10 * i + 1, 10 * i + 9))
        scheduler.add_request(make_request(f"batch-{i}", prompt, max_tokens=4 + 2 * i, interactive=False))
    step(scheduler, runner)
    assert sorted(r.request_id for r in scheduler.running) == ["batch-0", "batch-1"]
    # The seats above the limit are interactive traffic's.
    scheduler.add_request(make_request("interactive", list(range(100, 108)), max_tokens=3))
    step(scheduler, runner)
    assert len(scheduler.running) == 3
    # The waiting one takes a seat at the first step that finds fewer than 2 running.
    for _ in range(20):
        seated_before = len(scheduler.running)
        plan = step(scheduler, runner)
        admitted = "batch-2" in {new.request_id for new in plan.new_requests}
        assert admitted == (seated_before < 2), (seated_before, plan)
        if admitted:
            return
    raise AssertionError("batch-2 never started")


def test_a_batch_seat_limit_must_fit_the_seats():
    with pytest.raises(ValueError, match="max_batch_running"):
        SchedulerConfig(max_model_len=64, max_num_seqs=4, max_batch_running=5)


# ------------------------------------------------------------- n choices


def test_choices_copy_the_last_prompt_block_and_compute_only_their_last_token():
    scheduler, runner = make_scheduler()
    prompt = list(range(1, 12))  # 11 tokens: 2 full blocks and 3 tokens
    first = make_request("c/0", prompt, max_tokens=6)
    scheduler.add_request(first)
    while not first.output_token_ids:
        step(scheduler, runner)
    # As the router does: the other choices once choice 0 has its first token.
    others = [make_request(f"c/{i}", prompt, max_tokens=6) for i in (1, 2, 3)]
    for request in others:
        scheduler.add_request(request)
    plan = step(scheduler, runner)
    assert plan.num_scheduled_tokens == {"c/0": 1, "c/1": 1, "c/2": 1, "c/3": 1}
    assert [new.num_computed_tokens for new in plan.new_requests] == [10, 10, 10]
    partial = scheduler.kv.block_ids("c/0")[2]
    assert [source for source, _ in plan.kv_moves.duplicate] == [partial] * 3
    assert [scheduler.kv.block_ids(r.request_id)[2] for r in others] == [
        b for _, b in plan.kv_moves.duplicate
    ]
    run_to_completion(scheduler, runner)
    # The prompt once, and each other choice's last prompt token (3 x 3 tokens recomputed before).
    assert scheduler.counts.computed_tokens["interactive", "prefill"] == 11 + 3
    assert all(r.output_token_ids == reference_output(prompt, 6) for r in [first, *others])
    assert [r.num_cached_tokens for r in others] == [10, 10, 10]
    assert scheduler.kv.num_free_blocks == 64


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_choices_under_preemption_hold_their_own_tokens(seed):
    """Groups of choices of one prompt, choice 0 first and the others once it has a token, in a
    pool small enough to preempt: the simulated KV check proves every copied block holds the
    copying request's tokens, and the answers are what each prompt gives alone."""
    rng = random.Random(seed)
    num_blocks = 16
    scheduler, runner = make_scheduler(
        num_blocks=num_blocks, max_model_len=64, max_num_batched_tokens=16, max_num_seqs=8, max_waiting=64
    )
    requests: list[Request] = []
    pending: list[tuple[Request, list[Request]]] = []  # choice 0 has no token yet
    preempted = 0
    for i in itertools.count():
        if i >= 300 and not pending:
            break
        if i < 300 and rng.random() < 0.2:
            prompt = [rng.randrange(1, 50) for _ in range(rng.randint(1, 14))]
            first = make_request(f"g{i}/0", prompt, rng.randint(2, 20))
            others = [
                make_request(f"g{i}/{n}", prompt, first.max_tokens) for n in range(1, rng.randint(2, 5))
            ]
            scheduler.add_request(first)
            pending.append((first, others))
            requests += [first, *others]
        for group in [g for g in pending if g[0].output_token_ids]:
            pending.remove(group)
            for request in group[1]:
                scheduler.add_request(request)
        plan = step(scheduler, runner)
        preempted += sum(1 for r in plan.finished_request_ids if scheduler.get_request(r))
    run_to_completion(scheduler, runner)
    for request in requests:
        assert request.output_token_ids == reference_output(request.prompt_token_ids, request.max_tokens)
    assert scheduler.kv.num_free_blocks == num_blocks
    assert preempted > 0 and scheduler.kv.block_copies["duplicate"] > 0
