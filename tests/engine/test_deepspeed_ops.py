"""DeepSpeed's ops live in the environment's own folder, and a build lock a killed build left
behind stops a start with what to delete instead of hanging it."""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

import pytest

from cachet.engine.deepspeed_ops import StaleBuildLock, extensions_dir, wait_for_build_locks


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
