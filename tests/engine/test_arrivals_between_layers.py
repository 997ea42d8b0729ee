"""Interactive arrivals start between the layers of a step that carries batch work.

The scheduler side (which requests a step run inside another may take), the engine side
(when the host's look runs), and the whole loop on the real model: the interleaved run
gives every request the tokens an uninterleaved run gives it, and the arrival's first
token goes out before the step it arrived in ends.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from test_scheduler import SimulatedRunner, make_request, make_scheduler, step

from cachet.config import EngineSettings
from cachet.engine.arrival_lane import LANE_SWITCH_INTERVAL_SECONDS, ArrivalLane, spare_core_for_arrivals
from cachet.engine.core_loop import CoreLoop
from cachet.engine.engine_core import EngineCore
from cachet.engine.loop_builder import choose_arrival_lane
from cachet.engine.loop_messages import AbortRequest, AddRequest, Message, Reply, StepReport
from cachet.engine.model_runner import ModelRunner
from cachet.engine.request import Request, RequestStatus
from cachet.engine.sampling_params import SamplingParams
from cachet.engine.scheduler import SchedulerConfig
from cachet.engine.step_plan import StepPlan, StepResult
from cachet.models.tiny import write_tiny_model

# ------------------------------------------------------------------ scheduler


def _prompt(n: int, base: int = 1) -> list[int]:
    return list(range(base, base + n))


def test_arrivals_take_only_waiting_interactive_requests_into_free_seats():
    scheduler, _ = make_scheduler(max_num_seqs=3, max_num_batched_tokens=64)
    scheduler.add_request(make_request("running", _prompt(8, 100), interactive=False))
    scheduler.schedule()
    scheduler.add_request(make_request("batch", _prompt(8, 200), interactive=False))
    for base, request_id in enumerate(("first", "second", "third"), start=3):
        scheduler.add_request(make_request(request_id, _prompt(8, base * 100)))

    plan = scheduler.schedule_arrivals()

    # Two free seats, taken in queue order; the running request and the batch one are not in it.
    assert [new.request_id for new in plan.new_requests] == ["first", "second"]
    assert set(plan.num_scheduled_tokens) == {"first", "second"}
    assert plan.running == [] and plan.finished_request_ids == set()
    # A full house: nobody is preempted for the third; it waits for a regular step.
    assert scheduler.schedule_arrivals().is_empty
    assert scheduler.get_request("third").status == RequestStatus.WAITING
    assert scheduler.counts.preemptions == {"kv_cache": 0, "seat": 0}


def test_arrivals_leave_finished_ids_for_the_next_regular_plan():
    scheduler, _ = make_scheduler(max_num_batched_tokens=64)
    scheduler.add_request(make_request("done", _prompt(8), interactive=False))
    scheduler.schedule()
    scheduler.abort("done")
    scheduler.add_request(make_request("new", _prompt(8, 50)))
    assert scheduler.schedule_arrivals().finished_request_ids == set()
    assert scheduler.schedule().finished_request_ids == {"done"}


def test_a_preempted_request_resumes_in_a_regular_step_and_nothing_passes_it():
    # Four blocks of four: two 6-token prompts fill them, and the first decode preempts the newer.
    scheduler, runner = make_scheduler(num_blocks=4, max_num_batched_tokens=64)
    scheduler.add_request(make_request("older", _prompt(6, 10), max_tokens=8))
    scheduler.add_request(make_request("newer", _prompt(6, 20), max_tokens=8))
    for _ in range(4):  # prefill, then decodes up to the end of the second block
        step(scheduler, runner)
    assert scheduler.get_request("newer").status == RequestStatus.PREEMPTED
    scheduler.abort("older")  # every block free: room for it again, and for one behind it
    scheduler.add_request(make_request("behind", _prompt(2, 30), max_tokens=1))
    assert scheduler.schedule_arrivals().is_empty
    assert [new.request_id for new in scheduler.schedule().new_requests] == ["newer", "behind"]


# --------------------------------------------------------------------- engine


class LayeredRunner(SimulatedRunner):
    """A simulated runner that runs ``between_layers`` before it writes the step's KV, as a real
    one does before its later layers: a step run there that reused this step's blocks would
    be overwritten, and the slot checks of later steps would see it."""

    supports_between_layers = True

    def __init__(self, num_kv_blocks: int) -> None:
        super().__init__(num_kv_blocks)
        self.looks = 0

    def execute(self, plan: StepPlan, between_layers: Callable[[], None] | None = None) -> StepResult:
        if between_layers is not None:
            self.looks += 1
            between_layers()
        return super().execute(plan)


def _one_arrival(engine: EngineCore, request: Request) -> tuple[Callable[[], None], list[list[str]]]:
    """A host's look that, the first time it runs, adds ``request`` and starts it in a pass of its
    own; the list records which requests that pass gave outputs for."""
    arrived: list[list[str]] = []

    def arrivals() -> None:
        if not arrived:
            engine.add_request(request)
            outputs = engine.step_arrivals()
            assert outputs is not None
            arrived.append([output.request_id for output in outputs])

    return arrivals, arrived


def _engine(runner: SimulatedRunner) -> EngineCore:
    config = SchedulerConfig(max_model_len=128, max_num_batched_tokens=32, max_num_seqs=4)
    return EngineCore(runner, model="tiny", scheduler_config=config)


def test_a_step_with_batch_work_looks_for_arrivals_and_starts_them_inside():
    runner = LayeredRunner(num_kv_blocks=64)
    engine = _engine(runner)
    engine.add_request(make_request("batch", _prompt(8), max_tokens=20, interactive=False))
    engine.step()
    arrivals, arrived = _one_arrival(engine, make_request("interactive", _prompt(8, 50), max_tokens=3))

    outputs = engine.step(arrivals)
    assert arrived == [["interactive"]]
    assert [output.request_id for output in outputs] == ["batch"]
    # Both run on, the interactive one in regular steps now, each with its own KV intact.
    for _ in range(30):
        engine.step(arrivals)
    assert not engine.has_unfinished_requests()


def test_short_interactive_only_steps_and_runners_that_cannot_interleave_never_look():
    runner = LayeredRunner(num_kv_blocks=64)
    engine = _engine(runner)
    engine.add_request(make_request("interactive", _prompt(8, 50), max_tokens=3))
    while engine.has_unfinished_requests():
        engine.step(lambda: pytest.fail("a short interactive-only step looked for arrivals"))
    assert runner.looks == 0

    engine = _engine(SimulatedRunner(num_kv_blocks=64))
    engine.add_request(make_request("batch", _prompt(8), max_tokens=3, interactive=False))
    while engine.has_unfinished_requests():
        engine.step(lambda: pytest.fail("a runner without between_layers was given the look"))


# --------------------------------------------------------- the loop, real model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("arrivals") / "tiny")


class ScriptedInbox:
    """Hands the loop its commands at chosen looks and records what it sends, in order."""

    def __init__(self) -> None:
        self.to_deliver: list[tuple[int, object]] = []
        self.sent: list[Message] = []

    def take(self) -> list[tuple[int, object]]:
        taken, self.to_deliver = self.to_deliver, []
        return taken

    def send(self, message: Message) -> None:
        self.sent.append(message)


def _request(request_id: str, prompt: list[int], *, interactive: bool, max_tokens: int) -> Request:
    sampling = SamplingParams(temperature=0.0, ignore_eos=True)
    return Request(request_id, prompt, sampling, max_tokens, interactive=interactive)


def _generate(
    model_dir: Path, *, interleave: bool, lane: bool = False
) -> tuple[dict[str, list[int]], list[list[object]]]:
    """Six batch requests decoding; an interactive one arrives during step 3, an abort of one
    batch request during step 5. Tokens of every request, and per step what went out.
    ``lane``: the arrival's pass runs on an arrival lane's thread, beside the step."""
    torch.manual_seed(0)
    runner = ModelRunner(model_dir, dtype=torch.float32, device=torch.device("cpu"), kv_cache_bytes=8 << 20)
    config = SchedulerConfig(max_model_len=runner.max_model_len, max_num_batched_tokens=256, max_num_seqs=8)
    core = EngineCore(
        runner, model="tiny", scheduler_config=config, arrival_lane=ArrivalLane() if lane else None
    )
    loop = CoreLoop(core, arrivals_between_layers=interleave)
    prompts = {f"b{i}": [100 + 37 * i + j for j in range(21)] for i in range(6)}
    for request_id, prompt in prompts.items():
        loop.run(0, AddRequest(_request(request_id, prompt, interactive=False, max_tokens=12)))
    arrivals = {
        3: (1, AddRequest(_request("i", list(range(500, 530)), interactive=True, max_tokens=5))),
        5: (2, AbortRequest("b5")),
    }
    tokens: dict[str, list[int]] = {}
    per_step: list[list[object]] = []
    for step_index in range(40):
        inbox = ScriptedInbox()
        late = []
        if step_index in arrivals:
            if interleave:
                inbox.to_deliver.append(arrivals[step_index])
            else:
                late.append(arrivals[step_index])  # read after the step, as it would be without the look
        report = loop.step(time.perf_counter, inbox)
        for command_id, command in late:
            inbox.send(loop.run(command_id, command))
        per_step.append([*inbox.sent, report])
        for message in [*inbox.sent, report]:
            if isinstance(message, StepReport):
                for output in message.outputs:
                    tokens.setdefault(output.request_id, []).extend(output.new_token_ids)
        if not loop.has_work_now():
            break
    return tokens, per_step


def test_interleaved_steps_give_every_request_the_same_tokens(model_dir: Path):
    interleaved, _ = _generate(model_dir, interleave=True)
    on_the_lane, _ = _generate(model_dir, interleave=True, lane=True)
    plain, _ = _generate(model_dir, interleave=False)
    assert interleaved == plain
    # Two passes at once on two threads, the same cache tensor: each wrote only its own slots.
    assert on_the_lane == plain
    assert len(interleaved["i"]) == 5 and len(interleaved["b0"]) == 12


def test_a_real_step_looks_after_each_layers_attention_after_each_layer_and_inside_the_head(
    model_dir: Path,
):
    """An arrival (or a finished lane pass) waits for the next look: half a layer, not a whole one,
    nor the whole head (the biggest product of a small model)."""
    runner = ModelRunner(
        model_dir, dtype=torch.float32, device=torch.device("cpu"), kv_cache_bytes=8 << 20, pack_weights=False
    )
    head = runner.model.lm_head
    head.slice_rows = -(-head.out_features // 3)  # the tiny model's head is one slice otherwise
    config = SchedulerConfig(max_model_len=runner.max_model_len, max_num_batched_tokens=256, max_num_seqs=8)
    core = EngineCore(runner, model="tiny", scheduler_config=config)
    core.add_request(_request("b", list(range(100, 121)), interactive=False, max_tokens=4))
    looks: list[None] = []

    core.step(lambda: looks.append(None))

    assert runner.config.num_hidden_layers >= 2
    assert len(looks) == 2 * runner.config.num_hidden_layers + 2


@pytest.mark.parametrize("lane", [False, True], ids=["in-step", "lane"])
def test_the_arrivals_first_token_goes_out_before_the_step_it_arrived_in_ends(model_dir: Path, lane: bool):
    _, per_step = _generate(model_dir, interleave=True, lane=lane)
    reply, arrival_report, step_report = per_step[3]
    assert isinstance(reply, Reply) and reply.error is None
    assert isinstance(arrival_report, StepReport) and isinstance(step_report, StepReport)
    assert [(o.request_id, len(o.new_token_ids)) for o in arrival_report.outputs] == [("i", 1)]
    assert "i" not in {o.request_id for o in step_report.outputs}
    assert arrival_report.step_seconds is not None and step_report.step_seconds is not None
    # An abort read inside a step waits for its end: the step's blocks are still being written.
    abort_reply, step_report = per_step[5][-2:]
    assert isinstance(abort_reply, Reply) and abort_reply.value is True
    [b5] = [o for o in step_report.outputs if o.request_id == "b5"]
    assert b5.status == RequestStatus.RUNNING and len(b5.new_token_ids) == 1


class SlowLayeredRunner(LayeredRunner):
    """Steps that take ``step_seconds``, as a real model's do on a CPU."""

    def __init__(self, num_kv_blocks: int, step_seconds: float) -> None:
        super().__init__(num_kv_blocks)
        self.step_seconds = step_seconds

    def execute(self, plan: StepPlan, between_layers: Callable[[], None] | None = None) -> StepResult:
        time.sleep(self.step_seconds)
        return super().execute(plan, between_layers)


def test_interactive_only_steps_look_once_steps_are_long():
    runner = SlowLayeredRunner(num_kv_blocks=64, step_seconds=0.02)
    config = SchedulerConfig(max_model_len=128, max_num_batched_tokens=32, max_num_seqs=4)
    engine = EngineCore(runner, model="tiny", scheduler_config=config, interactive_look_min_step_seconds=0.01)
    engine.add_request(make_request("first", _prompt(8, 50), max_tokens=5))
    engine.step()  # the first step: nothing to go by yet, so it does not look
    assert runner.looks == 0
    arrivals, arrived = _one_arrival(engine, make_request("second", _prompt(8, 70), max_tokens=3))

    outputs = engine.step(arrivals)
    # The second one got its first token from a pass of its own inside the first one's step.
    assert runner.looks == 1 and arrived == [["second"]]
    assert [output.request_id for output in outputs] == ["first"]
    while engine.has_unfinished_requests():
        engine.step(arrivals)
    never = EngineCore(
        SlowLayeredRunner(num_kv_blocks=64, step_seconds=0.02),
        model="tiny",
        scheduler_config=config,
        interactive_look_min_step_seconds=None,
    )
    never.add_request(make_request("alone", _prompt(8, 90), max_tokens=3))
    while never.has_unfinished_requests():
        never.step(lambda: pytest.fail("interactive-only steps were told never to look"))


# ---------------------------------------------------------------- the arrival lane


def test_a_lane_pass_starts_only_inside_a_step_and_must_be_posted_before_the_next():
    runner = LayeredRunner(num_kv_blocks=64)
    config = SchedulerConfig(max_model_len=128, max_num_batched_tokens=32, max_num_seqs=4)
    engine = EngineCore(runner, model="tiny", scheduler_config=config, arrival_lane=ArrivalLane())
    engine.add_request(make_request("batch", _prompt(8), max_tokens=20, interactive=False))
    engine.step()
    engine.add_request(make_request("early", _prompt(8, 50), max_tokens=3))
    assert not engine.lane_free  # between steps: the next schedule() takes it
    with pytest.raises(RuntimeError, match="no step is running"):
        engine.start_arrivals()
    engine.step()
    posted: list[tuple[list[str], float]] = []

    def arrivals() -> None:
        if not posted:
            engine.add_request(make_request("late", _prompt(8, 70), max_tokens=3))
            assert engine.start_arrivals()
            assert not engine.lane_free  # the lane runs one pass at a time
            outputs, seconds = engine.finish_arrivals(wait=True)
            posted.append(([output.request_id for output in outputs], seconds))

    outputs = engine.step(arrivals)
    assert [ids for ids, _ in posted] == [["late"]] and posted[0][1] >= 0
    assert sorted(output.request_id for output in outputs) == ["batch", "early"]
    assert engine.finish_arrivals(wait=True) is None  # posted once

    def left_running() -> None:
        engine.add_request(make_request("forgotten", _prompt(8, 90), max_tokens=3))
        assert engine.start_arrivals()

    engine.step(left_running)
    with pytest.raises(RuntimeError, match="before the next step"):
        engine.step()
    [output] = engine.finish_arrivals(wait=True)[0]
    assert output.request_id == "forgotten" and len(output.new_token_ids) == 1
    while engine.has_unfinished_requests():
        engine.step()


def test_a_failed_lane_pass_raises_on_the_loop_thread():
    class FailingRunner(LayeredRunner):
        def execute(self, plan: StepPlan, between_layers: Callable[[], None] | None = None) -> StepResult:
            if between_layers is None and "doomed" in plan.num_scheduled_tokens:
                raise RuntimeError("the device fell over")
            return super().execute(plan, between_layers)

    config = SchedulerConfig(max_model_len=128, max_num_batched_tokens=32, max_num_seqs=4)
    engine = EngineCore(
        FailingRunner(num_kv_blocks=64), model="tiny", scheduler_config=config, arrival_lane=ArrivalLane()
    )
    engine.add_request(make_request("batch", _prompt(8), max_tokens=20, interactive=False))
    engine.step()

    def arrivals() -> None:
        engine.add_request(make_request("doomed", _prompt(8, 50), max_tokens=3))
        assert engine.start_arrivals()

    engine.step(arrivals)
    with pytest.raises(RuntimeError, match="fell over"):
        engine.finish_arrivals(wait=True)


def test_the_lane_is_for_a_one_thread_cpu_engine_with_a_core_to_spare(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr("os.sched_getaffinity", lambda _pid: {0, 1})
    assert spare_core_for_arrivals(torch.device("cpu"), math_threads=1)
    assert not spare_core_for_arrivals(torch.device("cpu"), math_threads=2)
    assert not spare_core_for_arrivals(torch.device("cuda"), math_threads=1)
    monkeypatch.setattr("os.sched_getaffinity", lambda _pid: {0})
    assert not spare_core_for_arrivals(torch.device("cpu"), math_threads=1)


def test_the_setting_and_the_runner_choose_the_lane(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr("os.sched_getaffinity", lambda _pid: {0, 1})
    cpu = torch.device("cpu")
    interleaving = SimpleNamespace(supports_between_layers=True)
    sharded = SimpleNamespace(supports_between_layers=False)  # a tensor-parallel replica's

    switch_intervals: list[float] = []
    monkeypatch.setattr(sys, "setswitchinterval", switch_intervals.append)

    def has_lane(runner: object, math_threads: int, **settings: object) -> bool:
        monkeypatch.setattr(torch, "get_num_threads", lambda: math_threads)
        switch_intervals.clear()
        lane = choose_arrival_lane(EngineSettings(**settings), runner, cpu)
        # A lane's process hands the interpreter lock to the lane's pass sooner; others keep it as it is.
        assert switch_intervals == ([LANE_SWITCH_INTERVAL_SECONDS] if lane else [])
        return lane is not None

    assert has_lane(interleaving, 1)
    assert not has_lane(interleaving, 2)
    assert has_lane(interleaving, 2, arrival_lane="on")
    assert not has_lane(interleaving, 1, arrival_lane="off")
    assert not has_lane(interleaving, 1, arrivals_between_layers=False)
    assert not has_lane(sharded, 1, arrival_lane="on")
