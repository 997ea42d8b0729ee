"""run-local's supervisor with real child processes: output under each name, a crashed child
restarted with backoff, one that keeps crashing stops everything with the reason, TERM stops all."""

from __future__ import annotations

import io
import sys
import threading
import time
from pathlib import Path

from cachet.supervisor import Supervisor


def python(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def run_until(supervisor: Supervisor, done, timeout: float = 30.0) -> int:
    """Run the supervisor in a thread until ``done()`` holds, then stop it; its return code."""
    result: list[int] = []
    runner = threading.Thread(target=lambda: result.append(supervisor.run()))
    runner.start()
    deadline = time.monotonic() + timeout
    while not done() and runner.is_alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    supervisor.terminate()
    runner.join(30)
    return result[0]


def test_a_crashed_child_is_restarted_and_the_others_keep_running(tmp_path: Path) -> None:
    marker = tmp_path / "crashed-once"
    out = io.StringIO()
    supervisor = Supervisor(out=out, backoff=(0.2,))
    # Crashes on its first start only (the marker survives the restart).
    supervisor.add(
        "flaky",
        python(
            f"import pathlib, sys, time; m = pathlib.Path({str(marker)!r})\n"
            "if not m.exists(): m.touch(); print('boom', flush=True); sys.exit(3)\n"
            "print('back up', flush=True); time.sleep(60)"
        ),
        {},
    )
    supervisor.add("steady", python("import time; print('steady up', flush=True); time.sleep(60)"), {})
    returncode = run_until(supervisor, lambda: "back up" in out.getvalue())
    log = out.getvalue()
    assert returncode == 0
    assert "flaky      | boom" in log and "flaky      | back up" in log
    assert "flaky exited (rc=3); restarting it in 0 s (crash 1 of at most 5" in log
    assert log.count("steady     | started (pid=") == 1
    assert log.count("flaky      | started (pid=") == 2
    # Stopped once each at the end (and flaky once more, when it crashed).
    assert log.count("steady     | stopped (rc=") == 1


def test_a_child_that_keeps_crashing_stops_everything_with_the_reason() -> None:
    out = io.StringIO()
    supervisor = Supervisor(out=out, max_crashes=2, backoff=(0.1,))
    supervisor.add("broken", python("import sys; sys.exit(7)"), {})
    supervisor.add("steady", python("import time; time.sleep(60)"), {})
    returncode = run_until(supervisor, lambda: supervisor.failure is not None)
    assert returncode == 1
    assert supervisor.failure == "broken exited 3 times in 300 s (last rc=7); stopping every service"
    assert "steady     | stopped (rc=" in out.getvalue()


def test_terminate_stops_every_child_and_what_it_started(tmp_path: Path) -> None:
    grandchild_pid = tmp_path / "grandchild.pid"
    out = io.StringIO()
    supervisor = Supervisor(out=out)
    # A service that starts a process of its own (as an engine starts its ranks).
    supervisor.add(
        "parent",
        python(
            "import subprocess, sys, time, pathlib\n"
            "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
            f"pathlib.Path({str(grandchild_pid)!r}).write_text(str(p.pid)); time.sleep(60)"
        ),
        {},
    )
    # The file exists from its open, before its pid is written: wait for the pid itself.
    assert run_until(supervisor, lambda: grandchild_pid.exists() and grandchild_pid.read_text() != "") == 0
    pid = int(grandchild_pid.read_text())
    deadline = time.monotonic() + 10
    while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    status = Path(f"/proc/{pid}/status")
    assert not status.exists() or "zombie" in status.read_text(), "the child's own process outlived the stop"
