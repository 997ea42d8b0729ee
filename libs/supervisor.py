"""Runs `cachet run-local`'s services as child processes and keeps them up.

Each child's output is printed under its name, as honcho printed it before (honcho restarts
nothing: one exit stopped every service). A child that exits while the supervisor is not
stopping is restarted after a backoff that doubles with each crash (1 s up to 30 s), and
the supervisor says so; the other services keep serving meanwhile
(the router fails requests over from a dead engine as it always does). A child that
crashes more than ``max_crashes`` times within ``crash_window`` seconds is not restarted:
everything is stopped and the reason printed. Ctrl-C or SIGTERM stops every child (TERM to
its process group, KILL after a grace period).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import FrameType
from typing import IO, Any

RESTART_BACKOFF_SECONDS = (1.0, 2.0, 4.0, 8.0, 16.0, 30.0)
MAX_CRASHES = 5
CRASH_WINDOW_SECONDS = 300.0
STOP_GRACE_SECONDS = 15.0
_POLL_SECONDS = 0.2

# What signal.signal takes and returns.
_SignalHandler = Callable[[int, FrameType | None], Any] | int | signal.Handlers | None


@dataclass
class _Child:
    name: str
    command: list[str]
    env: dict[str, str]
    process: subprocess.Popen[bytes] | None = None
    crashes: deque[float] = field(default_factory=deque)
    restart_at: float | None = None


class Supervisor:
    def __init__(
        self,
        *,
        out: IO[str] | None = None,
        max_crashes: int = MAX_CRASHES,
        crash_window: float = CRASH_WINDOW_SECONDS,
        backoff: tuple[float, ...] = RESTART_BACKOFF_SECONDS,
    ) -> None:
        self._out = out or sys.stdout
        self._max_crashes = max_crashes
        self._crash_window = crash_window
        self._backoff = backoff
        self._children: list[_Child] = []
        self._print_lock = threading.Lock()
        self._stopping = threading.Event()
        self.failure: str | None = None

    def add(self, name: str, command: list[str], env: Mapping[str, str]) -> None:
        self._children.append(_Child(name, list(command), dict(env)))

    def terminate(self) -> None:
        """Stop every child and return from ``run`` (any thread; signal handlers call it)."""
        self._stopping.set()

    def run(self) -> int:
        """Start every child and supervise them until stopped: 0 when asked to stop, 1 when a
        child crashed too often (``failure`` says which and how)."""
        handlers = self._install_signal_handlers()
        try:
            for child in self._children:
                self._start(child)
            while not self._stopping.wait(_POLL_SECONDS):
                for child in self._children:
                    self._watch(child)
        finally:
            self._stop_all()
            self._restore_signal_handlers(handlers)
        return 1 if self.failure else 0

    def _watch(self, child: _Child) -> None:
        now = time.monotonic()
        if child.process is None:
            if child.restart_at is not None and now >= child.restart_at:
                self._start(child)
            return
        returncode = child.process.poll()
        if returncode is None:
            return
        self._say(child.name, f"stopped (rc={returncode})")
        child.process = None
        child.crashes.append(now)
        while child.crashes and now - child.crashes[0] > self._crash_window:
            child.crashes.popleft()
        crashes = len(child.crashes)
        if crashes > self._max_crashes:
            self.failure = (
                f"{child.name} exited {crashes} times in {self._crash_window:.0f} s "
                f"(last rc={returncode}); stopping every service"
            )
            self._say("run-local", self.failure)
            self._stopping.set()
            return
        delay = self._backoff[min(crashes, len(self._backoff)) - 1]
        child.restart_at = now + delay
        self._say(
            "run-local",
            f"{child.name} exited (rc={returncode}); restarting it in {delay:.0f} s "
            f"(crash {crashes} of at most {self._max_crashes} in {self._crash_window:.0f} s)",
        )

    def _start(self, child: _Child) -> None:
        child.restart_at = None
        # A session of its own: stopping the child stops whatever it started (an engine's ranks).
        child.process = subprocess.Popen(
            child.command,
            env=child.env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        self._say(child.name, f"started (pid={child.process.pid})")
        threading.Thread(
            target=self._pump, args=(child.name, child.process), name=f"output-{child.name}", daemon=True
        ).start()

    def _pump(self, name: str, process: subprocess.Popen[bytes]) -> None:
        assert process.stdout is not None
        for raw in process.stdout:
            self._say(name, raw.decode(errors="replace").rstrip("\n"))

    def _stop_all(self) -> None:
        running = [c.process for c in self._children if c.process is not None and c.process.poll() is None]
        for process in running:
            _signal_group(process, signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_SECONDS
        for process in running:
            try:
                process.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _signal_group(process, signal.SIGKILL)
                process.wait()
        for child in self._children:
            if child.process is not None:
                self._say(child.name, f"stopped (rc={child.process.returncode})")
                child.process = None

    def _say(self, name: str, line: str) -> None:
        with self._print_lock:
            print(f"{time.strftime('%H:%M:%S')} {name:<10} | {line}", file=self._out, flush=True)

    def _install_signal_handlers(self) -> dict[int, _SignalHandler]:
        if threading.current_thread() is not threading.main_thread():
            return {}
        previous: dict[int, _SignalHandler] = {}
        for signum in (signal.SIGINT, signal.SIGTERM):
            previous[signum] = signal.signal(signum, lambda *_: self.terminate())
        return previous

    @staticmethod
    def _restore_signal_handlers(previous: dict[int, _SignalHandler]) -> None:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _signal_group(process: subprocess.Popen[bytes], signum: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signum)
