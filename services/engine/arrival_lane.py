"""A thread that runs interactive arrivals' forward passes beside the step in flight.

Without it an arrival's pass of its own runs between two layers of the loop's step, and
that step waits for it: on a CPU a pass has a fixed cost (streaming every weight once)
that the backlog pays per arrival. An engine that computes on one thread of a host with
another core to spare can run that pass on the spare core instead, while the step goes on.

What keeps the two passes apart: they hold disjoint requests (``schedule_arrivals`` never
takes one the step holds), so they write disjoint KV slots, and shared prefix blocks are
only read. The scheduler is touched on the loop's thread alone: the lane only runs the
runner, and the loop posts the lane's result (``EngineCore.finish_arrivals``) at a layer
boundary, or at the step's end, before anything is scheduled again.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from cachet.engine.step_plan import StepPlan, StepResult

# How long a thread may keep the interpreter lock while another waits for it, in a process
# with a lane. The lane's pass and the loop's step take turns on that lock between their
# operators, and at Python's default (5 ms) the step's scheduling and bookkeeping for 20-odd
# requests could hold the pass that long. A probe on the dev box (SmolLM2-135M beside a
# 20-request backlog, one thread each, 240 arrivals a setting, alternated): an arrival's lane
# pass to its posting took 79.7 / 91.7 / 99.9 ms at p50 / p95 / p99 at 5 ms, 78.3 / 87.4 /
# 94.5 at 0.5 ms, and the backlog ran as fast.
LANE_SWITCH_INTERVAL_SECONDS = 0.0005


@dataclass(frozen=True)
class LanePass:
    plan: StepPlan
    result: StepResult
    seconds: float


def spare_core_for_arrivals(device: torch.device, math_threads: int) -> bool:
    """Whether a lane would run on a core of its own: a CPU engine that computes on one thread
    (with more, the lane's would share their cores, and two threads on a core thrash) on a
    host with another core."""
    if device.type != "cpu" or math_threads != 1:
        return False
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return usable >= 2


class ArrivalLane:
    """One pass at a time, on one worker thread. Its operators run on as many threads as the
    loop's (torch's count is the process's): one, where ``spare_core_for_arrivals`` chose it."""

    def __init__(self) -> None:
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="arrival-lane")
        self._running: tuple[StepPlan, Future[tuple[StepResult, float]]] | None = None

    @property
    def busy(self) -> bool:
        """A pass was started and its result not yet taken (it may have ended)."""
        return self._running is not None

    def start(self, plan: StepPlan, execute: Callable[[StepPlan], StepResult]) -> None:
        if self._running is not None:
            raise RuntimeError("the arrival lane already runs a pass")
        self._running = (plan, self._executor.submit(self._run, plan, execute))

    def take(self, *, wait: bool) -> LanePass | None:
        """The pass that ended, once; None when none runs, or it runs still and ``wait`` is off.
        A pass that failed raises its error here, on the caller's thread."""
        if self._running is None or (not wait and not self._running[1].done()):
            return None
        (plan, future), self._running = self._running, None
        result, seconds = future.result()
        return LanePass(plan, result, seconds)

    @staticmethod
    def _run(plan: StepPlan, execute: Callable[[StepPlan], StepResult]) -> tuple[StepResult, float]:
        started = time.perf_counter()
        result = execute(plan)
        return result, time.perf_counter() - started
