"""Filesystem helpers shared by the model writers: all-or-nothing directories and a process lock."""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import socket
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

# A checkpoint directory is usable only when all of these are there; writers create them in a staging
# directory and rename it into place, so a reader never sees a subset.
CHECKPOINT_FILES = (
    "config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "generation_config.json",
)

_PARTIAL_MARK = ".partial-"


def is_complete_checkpoint(path: Path) -> bool:
    return path.is_dir() and all((path / name).is_file() for name in CHECKPOINT_FILES)


def _partial_prefix(target: Path) -> str:
    # Host and pid in the name let a later run tell an abandoned staging directory (its writer died)
    # from one that a live process is still filling.
    return f".{target.name}{_PARTIAL_MARK}{socket.gethostname()}-{os.getpid()}-"


def _seal_tree(root: Path) -> None:
    """Flush every file and give the tree ordinary read permissions before it is renamed into place."""
    # mkdtemp makes 0700 directories and safetensors writes 0600 files; services running as another
    # user must still be able to read the checkpoint.
    root.chmod(0o755)
    for path in root.rglob("*"):
        if path.is_dir():
            path.chmod(0o755)
        elif path.is_file():
            path.chmod(0o644)
            # Rename is atomic, but without flushing first a power cut right after it could leave a
            # complete-looking directory of empty files.
            with open(path, "rb") as handle:
                os.fsync(handle.fileno())
    fd = os.open(root, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextmanager
def atomic_directory(target: Path, *, overwrite: bool = False) -> Iterator[Path]:
    """Yield an empty staging directory next to `target`; on success it becomes `target` in one rename.

    If the body raises (or the process dies), `target` is untouched and the staging directory is
    removed (or, after a kill, swept later by `sweep_abandoned_partials`).
    """
    target = Path(target)
    if target.exists() and not overwrite:
        raise FileExistsError(f"{target} already exists; remove it or pass overwrite=True")
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=_partial_prefix(target), dir=target.parent))
    try:
        yield staging
        _seal_tree(staging)
        if target.exists():
            # Move the old copy aside first: rename cannot replace a non-empty directory.
            retired = Path(tempfile.mkdtemp(prefix=_partial_prefix(target), dir=target.parent))
            retired.rmdir()
            target.rename(retired)
            staging.rename(target)
            shutil.rmtree(retired, ignore_errors=True)
        else:
            staging.rename(target)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)


def sweep_abandoned_partials(target: Path) -> list[Path]:
    """Remove staging directories for `target` whose writer on this host is no longer running."""
    removed: list[Path] = []
    parent = Path(target).parent
    if not parent.is_dir():
        return removed
    host = socket.gethostname()
    prefix = f".{Path(target).name}{_PARTIAL_MARK}{host}-"
    for candidate in parent.iterdir():
        if not candidate.name.startswith(prefix) or not candidate.is_dir():
            continue
        pid_text = candidate.name[len(prefix) :].split("-", 1)[0]
        if pid_text.isdigit() and not _pid_alive(int(pid_text)):
            shutil.rmtree(candidate, ignore_errors=True)
            removed.append(candidate)
    return removed


def _pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """Exclusive advisory lock, so that services starting together convert the model only once."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as handle:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


def read_json(path: Path) -> dict[str, Any]:
    return json.loads(Path(path).read_text(encoding="utf-8"))


def write_json(path: Path, payload: dict[str, Any]) -> None:
    Path(path).write_text(json.dumps(payload, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
