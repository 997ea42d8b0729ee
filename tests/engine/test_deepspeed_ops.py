"""DeepSpeed's ops live in the environment's own folder, and a build lock a killed build left
behind stops a start with what to delete instead of hanging it."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from service_processes import launch_service

from cachet.engine.deepspeed_ops import StaleBuildLock, extensions_dir, wait_for_build_locks
from cachet.models.tiny import write_tiny_model


def test_the_folder_is_the_environments_unless_the_operator_names_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    assert extensions_dir() == Path(sys.prefix) / "torch_extensions"
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", "/somewhere/else")
    assert extensions_dir() == Path("/somewhere/else")


def test_a_stale_build_lock_fails_fast_naming_the_file(tmp_path: Path) -> None:
    lock = tmp_path / "py311_cpu" / "deepspeed_shm_comm" / "lock"
    lock.parent.mkdir(parents=True)
    lock.touch()
    start = time.monotonic()
    with pytest.raises(StaleBuildLock, match=f"rm {lock}"):
        wait_for_build_locks(tmp_path, timeout=1.5)
    assert time.monotonic() - start < 5


def test_a_build_in_progress_is_waited_for(tmp_path: Path) -> None:
    lock = tmp_path / "deepspeed_shm_comm" / "lock"
    lock.parent.mkdir(parents=True)
    lock.touch()
    threading.Timer(1.0, lock.unlink).start()
    wait_for_build_locks(tmp_path, timeout=30)
    assert not lock.exists()


def test_no_lock_no_wait(tmp_path: Path) -> None:
    start = time.monotonic()
    wait_for_build_locks(tmp_path / "missing", timeout=30)
    assert time.monotonic() - start < 1


def test_a_tensor_parallel_engine_start_fails_fast_on_a_stale_lock(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The issue's hang, end to end: a real ``CACHET_TP=2`` engine (rank 0 and a spawned rank)
    whose op folder holds a lock a killed build left exits within seconds of the lowered
    timeout, its log naming the file to delete; before, the start waited on it forever."""
    folder = tmp_path / "torch_extensions"
    lock = folder / "deepspeed_shm_comm" / "lock"
    lock.parent.mkdir(parents=True)
    lock.touch()
    # The op folder the engine's ranks read (rank 0 and the followers inherit it).
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(folder))
    env = {
        "CACHET_MODEL": str(write_tiny_model(tmp_path / "tiny")),
        "CACHET_TP": "2",
        "CACHET_DTYPE": "float32",
        "CACHET_ENGINE_BUILD_LOCK_TIMEOUT_SECONDS": "2",
    }
    engine = launch_service("engine", env, tmp_path, name="engine-tp2")
    started = time.monotonic()
    try:
        # Imports, spawning the second rank and the 2 s wait: well under a minute on 2 busy cores.
        returncode = engine.process.wait(timeout=90)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the engine still runs 90 s after its start:\n{engine.log_tail()}")
    finally:
        engine.stop()
    assert returncode != 0
    # Rank 0's last words: one line saying what to delete, not a traceback.
    last_line = engine.output().strip().splitlines()[-1]
    assert last_line.startswith("cachet engine: A compiled op's build lock"), engine.log_tail()
    assert f"rm {lock}" in last_line
    assert lock.exists(), "the start must not delete a lock it cannot prove stale"
    assert time.monotonic() - started < 90
