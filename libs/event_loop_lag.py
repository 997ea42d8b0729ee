"""How late an asyncio service's event loop runs a callback that is due: its queueing delay.

Every message of every request in a service waits in that one queue, behind whatever
callbacks are ready first. On the 2-core dev box, beside a backlog of queued jobs, the
router's loop ran a due callback more than 10 ms late several times a second (half of it
its own queue of callbacks, half waiting for a core), and an interactive first token passes
through that queue twice. CPU per process cannot show those waits; this histogram does.
"""

from __future__ import annotations

import asyncio

from prometheus_client import Histogram

LAG_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)


class EventLoopLagMonitor:
    """Schedules a callback every ``interval_seconds`` and observes how late each one ran."""

    def __init__(self, histogram: Histogram, interval_seconds: float = 0.05) -> None:
        self._histogram = histogram
        self._interval = interval_seconds
        self._handle: asyncio.TimerHandle | None = None

    def start(self) -> None:
        """Begin on the running loop; a second call while running does nothing."""
        if self._handle is None:
            self._schedule(asyncio.get_running_loop())

    def stop(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None

    def _schedule(self, loop: asyncio.AbstractEventLoop) -> None:
        due = loop.time() + self._interval
        self._handle = loop.call_at(due, self._tick, loop, due)

    def _tick(self, loop: asyncio.AbstractEventLoop, due: float) -> None:
        self._histogram.observe(max(0.0, loop.time() - due))
        self._schedule(loop)
