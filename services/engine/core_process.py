"""The engine loop in a process of its own, forked by the server before it serves.

Why: in one process the step loop and the gRPC side take turns on one interpreter lock.
Measured on the 2-core dev box with the tiny model: a thread holding the lock 30% of the
time in short slices stretched a 20-request step from 8.1 to 13.0 ms, and a server
streaming to interactive clients beside a backlog held it about that much (py-spy
``--gil``), while half a core stood idle. In a process of its own the loop has its
interpreter to itself and the gRPC side runs on another core. vLLM splits its engine
core from its API server for the same reason.

Two one-way pipes carry pickled messages (``core_loop``): commands in, replies and step
reports out, in order. The server writes from a thread of its own, so a full pipe never
blocks its event loop (and the loop, blocked writing a report, never waits on a server
blocked writing a command); it reads reports on the event loop.

The loop process lives for its server: it ignores SIGINT and SIGTERM (the server drains
first, then tells it to stop) and exits when its command pipe closes, so a server killed
with SIGKILL takes its loop down at the next step.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import queue
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection, Pipe, wait

from cachet.engine.core_loop import Command, CoreLoop, EngineDescription, Message
from cachet.engine.errors import EngineUnavailable
from cachet.logs import get_logger

log = get_logger(__name__)

# How long a planned stop waits for the loop process before killing it.
_STOP_TIMEOUT_SECONDS = 10.0


@dataclass(frozen=True)
class CoreFailed:
    """The loop process could not start (its first message, in place of the description)."""

    error: str


class CoreStartFailed(RuntimeError):
    pass


class ProcessHost:
    """The server's side of a loop process."""

    def __init__(
        self, pid: int, commands: Connection, reports: Connection, description: EngineDescription
    ) -> None:
        self.pid = pid
        self.description = description
        self._commands = commands
        self._reports = reports
        self._outbox: queue.SimpleQueue[tuple[int, Command] | None] = queue.SimpleQueue()
        self._writer: threading.Thread | None = None
        self._event_loop: asyncio.AbstractEventLoop | None = None
        self._stopping = False

    @classmethod
    def launch(cls, build: Callable[[], tuple[CoreLoop, EngineDescription]]) -> ProcessHost:
        """Fork the loop process, which runs ``build`` (loads the model) and then the loop;
        returns once it is ready. Call before any thread starts: a fork copies only the
        calling thread, and a lock another thread held would stay held in the child."""
        commands_out, commands_in = Pipe(duplex=False)
        reports_out, reports_in = Pipe(duplex=False)
        pid = os.fork()
        if pid == 0:  # the loop process
            status = 1
            try:
                commands_in.close()
                reports_out.close()
                status = _run_loop_process(build, commands_out, reports_in)
            finally:
                os._exit(status)
        commands_out.close()
        reports_in.close()
        try:
            first = reports_out.recv()
        except EOFError:
            first = CoreFailed("the engine loop process exited while loading the model")
        if isinstance(first, CoreFailed):
            os.waitpid(pid, 0)
            raise CoreStartFailed(first.error)
        return cls(pid, commands_in, reports_out, first)

    def start(self, deliver: Callable[[Message], None], failed: Callable[[BaseException], None]) -> None:
        self._event_loop = asyncio.get_running_loop()
        self._event_loop.add_reader(self._reports.fileno(), self._read, deliver, failed)
        self._writer = threading.Thread(target=self._write, name="engine-core-writer", daemon=True)
        self._writer.start()

    def send(self, command_id: int, command: Command) -> None:
        self._outbox.put((command_id, command))

    async def stop(self) -> None:
        # Reports are still read (and go nowhere) until the loop process exits: one blocked
        # writing a report to a server that stopped reading would never read its stop.
        self._stopping = True
        self._outbox.put(None)
        await asyncio.to_thread(self._reap, _STOP_TIMEOUT_SECONDS)
        if self._event_loop is not None:
            self._event_loop.remove_reader(self._reports.fileno())
        self._reports.close()

    def _write(self) -> None:
        while (item := self._outbox.get()) is not None:
            try:
                self._commands.send(item)
            except OSError:
                return  # the loop process is gone; the reader reports it
        with contextlib.suppress(OSError):
            self._commands.send(None)  # the stop command
        self._commands.close()

    def _read(self, deliver: Callable[[Message], None], failed: Callable[[BaseException], None]) -> None:
        try:
            while self._reports.poll():
                deliver(self._reports.recv())
        except (EOFError, OSError):
            assert self._event_loop is not None
            self._event_loop.remove_reader(self._reports.fileno())
            if not self._stopping:
                status = self._reap(1.0)
                failed(EngineUnavailable(f"the engine loop process exited (status {status})"))

    def _reap(self, timeout: float) -> int | None:
        """The loop process's exit status; killed if it has not exited within ``timeout``."""
        deadline = time.monotonic() + timeout
        while True:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                return os.waitstatus_to_exitcode(status)
            if time.monotonic() >= deadline:
                log.warning("engine loop process did not stop; killing it", pid=self.pid)
                os.kill(self.pid, signal.SIGKILL)
                return os.waitstatus_to_exitcode(os.waitpid(self.pid, 0)[1])
            time.sleep(0.05)


def _run_loop_process(
    build: Callable[[], tuple[CoreLoop, EngineDescription]], commands: Connection, reports: Connection
) -> int:
    """The loop process's life; its exit status."""
    # The server drains in-flight requests on these, then stops this process itself.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        loop, description = build()
    except Exception as error:  # noqa: BLE001 - the server reports it and exits
        log.exception("engine loop process failed to start")
        reports.send(CoreFailed(f"{type(error).__name__}: {error}"))
        return 1
    wake_reader, wake_writer = os.pipe()
    fcntl.fcntl(wake_writer, fcntl.F_SETFL, os.O_NONBLOCK)

    def wake() -> None:
        # From a grammar compiler's thread; one pending byte is wake-up enough.
        with contextlib.suppress(BlockingIOError):
            os.write(wake_writer, b"\0")

    loop.set_wake(wake)
    reports.send(description)
    try:
        _serve(loop, commands, reports, wake_reader)
    except EOFError:
        log.info("engine server gone; engine loop process exiting")
    except BaseException:  # noqa: BLE001 - logged here, seen by the server as this process's exit
        log.exception("engine loop died")
        return 1
    return 0


def _serve(loop: CoreLoop, commands: Connection, reports: Connection, wake_reader: int) -> None:
    while True:
        # Idle (nothing to step, or only grammars still compiling): sleep until a command or a
        # grammar's wake-up; busy: only look.
        ready = wait([commands, wake_reader], timeout=0 if loop.has_work_now() else None)
        if wake_reader in ready:
            os.read(wake_reader, 4096)
        if commands in ready:
            ran = False
            while commands.poll():
                item = commands.recv()
                if item is None:
                    return
                reports.send(loop.run(*item))
                ran = True
            if ran:
                reports.send(loop.report_without_step())
        if loop.has_work_now():
            reports.send(loop.step(time.perf_counter))
