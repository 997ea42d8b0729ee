"""The engine loop in a process of its own, started by the server before it serves.

Why: in one process the step loop and the gRPC side take turns on one interpreter lock.
Measured on the 2-core dev box with the tiny model: a thread holding the lock 30% of the
time in short slices stretched a 20-request step from 8.1 to 13.0 ms, and a server
streaming to interactive clients beside a backlog held it about that much (py-spy
``--gil``), while half a core stood idle. In a process of its own the loop has its
interpreter to itself and the gRPC side runs on another core. vLLM splits its engine
core from its API server for the same reason.

Two one-way pipes carry pickled messages (``core_loop``): commands in, replies and step
reports out, in order. The server writes commands from its event loop without blocking
(``pipe_writer``: what a full pipe cannot take waits in a buffer), so the loop, blocked
writing a report, never waits on a server blocked writing a command; it reads reports on
the event loop.

The loop process is a fresh interpreter (``python -m cachet.engine.core_process``), not a
fork: a process that has touched CUDA (``torch.cuda.is_available()`` included) or started
threads (gRPC, the span exporter) cannot be forked safely. It reads the same
``CACHET_*`` environment as its server, and lives for it: it ignores SIGINT and SIGTERM
(the server drains first, then tells it to stop) and exits when its command pipe closes,
so a server killed with SIGKILL takes its loop down at its next step.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import TYPE_CHECKING

from cachet.engine.loop_messages import Command, EngineDescription, Message
from cachet.engine.pipe_writer import PipeWriter
from cachet.engine.rank_environment import externally_launched
from cachet.engine.settings import EngineSettings
from cachet.logs import configure_logging, get_logger
from cachet.startup_heap import freeze_startup_heap

if TYPE_CHECKING:  # torch and the model code, which the server process never imports
    from cachet.engine.core_loop import CoreLoop

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

    def __init__(self, process: subprocess.Popen[bytes], commands_fd: int, reports: Connection) -> None:
        self.process = process
        self._commands_fd = commands_fd
        self._commands: PipeWriter | None = None
        self._reports = reports
        self._event_loop: asyncio.AbstractEventLoop | None = None
        self._stopping = False
        self._description: EngineDescription | None = None
        self._exit_report: asyncio.Task[None] | None = None

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def description(self) -> EngineDescription:
        assert self._description is not None, "wait_ready() first"
        return self._description

    @classmethod
    def spawn(cls) -> ProcessHost:
        """Start the loop process, which loads the model (from this process's environment) and
        then runs the loop; ``wait_ready`` waits for it."""
        commands_read, commands_write = os.pipe()
        reports_read, reports_write = os.pipe()
        process = subprocess.Popen(
            [sys.executable, "-m", "cachet.engine.core_process", str(commands_read), str(reports_write)],
            pass_fds=(commands_read, reports_write),
        )
        os.close(commands_read)
        os.close(reports_write)
        return cls(process, commands_write, Connection(reports_read, writable=False))

    def wait_ready(self) -> None:
        """Until the model is loaded; CoreStartFailed (the process reaped) if it could not be."""
        try:
            first = self._reports.recv()
        except EOFError:
            status = self.process.wait()
            first = CoreFailed(f"the engine loop process exited while loading the model (status {status})")
        if isinstance(first, CoreFailed):
            os.close(self._commands_fd)
            self._reports.close()
            self.process.wait()
            raise CoreStartFailed(first.error)
        self._description = first

    def start(self, deliver: Callable[[Message], None], failed: Callable[[BaseException], None]) -> None:
        self._event_loop = asyncio.get_running_loop()
        self._event_loop.add_reader(self._reports.fileno(), self._read, deliver, failed)
        self._commands = PipeWriter(self._commands_fd, self._event_loop)

    def send(self, command_id: int, command: Command) -> None:
        assert self._commands is not None, "start() first"
        self._commands.send((command_id, command))

    async def stop(self) -> None:
        # Reports are still read (and go nowhere) until the loop process exits: one blocked
        # writing a report to a server that stopped reading would never read its stop.
        self._stopping = True
        if self._commands is not None:
            self._commands.send(None)  # the stop command
            self._commands.close()
        await asyncio.to_thread(self._reap, _STOP_TIMEOUT_SECONDS)
        if self._commands is not None:
            self._commands.abandon()  # the process is gone: nobody reads what the pipe still holds
        if self._event_loop is not None:
            self._event_loop.remove_reader(self._reports.fileno())
        self._reports.close()

    def _read(self, deliver: Callable[[Message], None], failed: Callable[[BaseException], None]) -> None:
        try:
            while self._reports.poll():
                deliver(self._reports.recv())
        except (EOFError, OSError):
            assert self._event_loop is not None
            self._event_loop.remove_reader(self._reports.fileno())
            if not self._stopping:
                # Reaped off the event loop: a process that closed its pipe may take a while to exit.
                self._exit_report = self._event_loop.create_task(self._report_exit(failed))

    async def _report_exit(self, failed: Callable[[BaseException], None]) -> None:
        from cachet.engine.errors import EngineUnavailable

        status = await asyncio.to_thread(self._reap, 1.0)
        failed(EngineUnavailable(f"the engine loop process exited (status {status})"))

    def _reap(self, timeout: float) -> int:
        """The loop process's exit status; killed if it has not exited within ``timeout``."""
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            log.warning("engine loop process did not stop; killing it", pid=self.pid)
            self.process.kill()
            return self.process.wait()


def _run_loop_process(
    build: Callable[[], tuple[CoreLoop, EngineDescription]], commands: Connection, reports: Connection
) -> int:
    """The loop process's life; its exit status."""
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
    freeze_startup_heap()
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
            reports.send(loop.step())


def runs_loop_process(settings: EngineSettings) -> bool:
    """Whether the replica's model runs in a loop process of its own, its server only relaying:
    a single rank (TP = EP = 1, not started by a launcher), unless the loop is asked onto a thread."""
    single_rank = settings.tensor_parallel_size == 1 and settings.expert_parallel_size == 1
    return single_rank and not externally_launched() and settings.core_process


def launch_early() -> ProcessHost | None:
    """The loop process of a single-rank replica, started (not yet ready); None where the model
    runs in the server's process (``runs_loop_process``). Called before the server imports the
    rest of its code, so the loop process's imports (torch, the model code) run beside them."""
    return ProcessHost.spawn() if runs_loop_process(EngineSettings()) else None


def main(arguments: list[str]) -> int:
    """``python -m cachet.engine.core_process COMMANDS_FD REPORTS_FD``, started by the server."""
    # The server drains in-flight requests on these, then stops this process itself.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    commands_fd, reports_fd = (int(argument) for argument in arguments)
    settings = EngineSettings()
    configure_logging("engine", settings.log_level)
    # Here, not at the top: the server imports this module before torch (launch_early).
    import torch

    from cachet.engine.loop_builder import build_core_loop, threads_per_rank

    torch.set_num_threads(threads_per_rank(settings))
    commands = Connection(commands_fd, writable=False)
    reports = Connection(reports_fd, readable=False)
    return _run_loop_process(lambda: build_core_loop(settings), commands, reports)


if __name__ == "__main__":
    # Through the module by its name: what this process pickles (CoreFailed) must unpickle in
    # the server as cachet.engine.core_process's, not as __main__'s.
    from cachet.engine import core_process

    sys.exit(core_process.main(sys.argv[1:]))
