"""Disaggregated prefill, the prefill replica's half: hold a hand-off's answer until its KV is
where the decode replica will look.

A request that hands its KV off (``Request.hand_off_kv``, sent by the router to a replica of
role ``prefill``) runs like any other: its prompt is computed and one token sampled. Its KV
reaches the decode replica straight into that replica's memory (``kv_transfer``, when the
router names its receiver: ``Request.hand_off_to``) and through the shared KV tier
(``shared_kv_tier``) where there is one, so its answer must not leave before every full block
of its prompt is there: the router opens the decode request as soon as the answer arrives,
and the decode replica loads what it finds.

Blocks are named when the step that computed them ends; the next step's plan copies them out
of the pool and the runner queues their sends and writes on the transfer's and the tier's
workers, which run their work in order. So a barrier queued on those workers after the next
step's execution is done exactly when the request's blocks are delivered and written: the held
answer goes out with the first step after that. A send or write that fails (a lost receiver, a
full disk) only means the decode replica recomputes those blocks.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING

from cachet.engine.request_output import RequestOutput

if TYPE_CHECKING:
    from cachet.engine.kv_transfer import KvSender
    from cachet.engine.shared_kv_tier import SharedKvFiles


@dataclass
class _Held:
    output: RequestOutput
    # The blocks handed over (a tensor-parallel replica's rank 0 also waits for the other ranks'
    # shards of these).
    block_hashes: list[int]
    # None until a step has queued the request's block writes.
    written: Future[None] | None = None


class KvHandOffs:
    """Answers of finished hand-off requests, held until their KV is in the shared tier."""

    def __init__(
        self, shared_tier: SharedKvFiles | None, sender: KvSender | None, wake: Callable[[], None]
    ) -> None:
        self._tier = shared_tier
        self._sender = sender
        self._wake = wake
        self._held: list[_Held] = []

    def _barrier(self, block_hashes: list[int]) -> Future[None]:
        """Done once every send and write queued so far has ended (and every rank's shard of
        ``block_hashes`` is written)."""
        queued = [self._tier.after_queued_work(block_hashes)] if self._tier is not None else []
        queued += [self._sender.after_queued_work()] if self._sender is not None else []
        done: Future[None] = Future()
        lock = threading.Lock()
        remaining = [len(queued)]

        def one_done(_: Future[None]) -> None:
            with lock:  # the workers' threads finish in any order
                remaining[0] -= 1
                last = remaining[0] == 0
            if last:
                done.set_result(None)

        for future in queued:
            future.add_done_callback(one_done)
        if not queued:
            done.set_result(None)
        return done

    def hold(self, output: RequestOutput, block_hashes: list[int]) -> None:
        """Hold a request's last answer; its blocks (``block_hashes``) were named by the step
        that just ended."""
        self._held.append(_Held(output, block_hashes))

    def after_execute(self) -> None:
        """Call after a step's plan ran: the blocks of every answer held before it are queued
        for writing now, so a barrier behind them says when they are written."""
        for held in self._held:
            if held.written is None:
                held.written = self._barrier(held.block_hashes)
                held.written.add_done_callback(lambda _: self._wake())

    def take_released(self) -> list[RequestOutput]:
        """The held answers whose blocks are written."""
        released = [h.output for h in self._held if h.written is not None and h.written.done()]
        for output in released:
            if output.timeline is not None:
                output.timeline.kv_handed_off_ns = time.time_ns()
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
