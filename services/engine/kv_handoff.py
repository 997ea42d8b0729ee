"""Disaggregated prefill, the prefill replica's half: hold a hand-off's answer until its KV is
written.

A request that hands its KV off (``Request.hand_off_kv``, sent by the router to a replica of
role ``prefill``) runs like any other: its prompt is computed and one token sampled. Its KV
reaches the decode replica through the shared KV tier (``shared_kv_tier``), so its answer must
not leave before every full block of its prompt is written there: the router opens the decode
request as soon as the answer arrives, and the decode replica loads what it finds.

Blocks are named when the step that computed them ends; the next step's plan copies them out
of the pool and the runner queues their writes on the tier's worker, which runs its work in
order. So a barrier queued on that worker after the next step's execution is done exactly when
the request's blocks are written: the held answer goes out with the first step after that.
A write that fails (a full disk) only means the decode replica recomputes those blocks.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING

from cachet.engine.request_output import RequestOutput

if TYPE_CHECKING:
    from cachet.engine.shared_kv_tier import SharedKvFiles


@dataclass
class _Held:
    output: RequestOutput
    # None until a step has queued the request's block writes.
    written: Future[None] | None = None


class KvHandOffs:
    """Answers of finished hand-off requests, held until their KV is in the shared tier."""

    def __init__(self, shared_tier: SharedKvFiles, wake: Callable[[], None]) -> None:
        self._tier = shared_tier
        self._wake = wake
        self._held: list[_Held] = []

    def hold(self, output: RequestOutput) -> None:
        """Hold a request's last answer; its blocks were named by the step that just ended."""
        self._held.append(_Held(output))

    def after_execute(self) -> None:
        """Call after a step's plan ran: the blocks of every answer held before it are queued
        for writing now, so a barrier behind them says when they are written."""
        for held in self._held:
            if held.written is None:
                held.written = self._tier.after_queued_work()
                held.written.add_done_callback(lambda _: self._wake())

    def take_released(self) -> list[RequestOutput]:
        """The held answers whose blocks are written."""
        released = [h.output for h in self._held if h.written is not None and h.written.done()]
        if released:
            self._held = [h for h in self._held if h.written is None or not h.written.done()]
        return released

    @property
    def has_work_now(self) -> bool:
        """A step is due: one must queue a barrier, or an answer is ready to go. Answers waiting
        on their writes need no step (the barrier wakes the loop)."""
        return any(h.written is None or h.written.done() for h in self._held)

    def __len__(self) -> int:
        return len(self._held)
