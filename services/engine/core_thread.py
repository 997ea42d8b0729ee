"""The engine loop on a thread of the server's process.

What a replica of several ranks uses: rank 0's loop drives the followers through the
process group this process owns. The loop shares the interpreter lock with the gRPC
side, so a busy server's message handling stretches the steps (``core_process`` avoids
that for single-rank replicas).
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import Callable

from cachet.engine.core_loop import CoreLoop
from cachet.engine.loop_messages import Command, EngineDescription, Message
from cachet.logs import get_logger

log = get_logger(__name__)

# How long the idle loop sleeps waiting for a command before re-checking for work.
_IDLE_WAIT_SECONDS = 0.05


class ThreadHost:
    def __init__(self, loop: CoreLoop, description: EngineDescription) -> None:
        self._core_loop = loop
        self.description = description
        # None is the wake-up: an empty command that only ends an idle wait.
        self._commands: queue.SimpleQueue[tuple[int, Command] | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        loop.set_wake(lambda: self._commands.put(None))

    def start(self, deliver: Callable[[Message], None], failed: Callable[[BaseException], None]) -> None:
        event_loop = asyncio.get_running_loop()
        self._thread = threading.Thread(
            target=self._run, args=(event_loop, deliver, failed), name="engine-loop", daemon=True
        )
        self._thread.start()

    def send(self, command_id: int, command: Command) -> None:
        self._commands.put((command_id, command))

    async def stop(self) -> None:
        self._stopping.set()
        self._commands.put(None)
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)

    def _run(
        self,
        event_loop: asyncio.AbstractEventLoop,
        deliver: Callable[[Message], None],
        failed: Callable[[BaseException], None],
    ) -> None:
        loop = self._core_loop
        try:
            while not self._stopping.is_set():
                # Requests that only wait for their grammar leave nothing to step: block until a
                # command (or the grammar's wake-up) arrives rather than spin on empty steps.
                if self._run_commands(block=not loop.has_work_now(), event_loop=event_loop, deliver=deliver):
                    event_loop.call_soon_threadsafe(deliver, loop.report_without_step())
                if loop.has_work_now():
                    event_loop.call_soon_threadsafe(deliver, loop.step())
        except BaseException as error:  # noqa: BLE001 - a dead loop must be visible, not silent
            log.exception("engine loop died")
            event_loop.call_soon_threadsafe(failed, error)

    def _run_commands(
        self, *, block: bool, event_loop: asyncio.AbstractEventLoop, deliver: Callable[[Message], None]
    ) -> bool:
        """Run what commands are queued (waiting a while for one if ``block``); True if any ran."""
        ran = False
        try:
            item = self._commands.get(timeout=_IDLE_WAIT_SECONDS) if block else self._commands.get_nowait()
            while True:
                if item is not None:
                    event_loop.call_soon_threadsafe(deliver, self._core_loop.run(*item))
                    ran = True
                item = self._commands.get_nowait()
        except queue.Empty:
            return ran
