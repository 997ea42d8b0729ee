"""Where DeepSpeed's compiled ops live, and a start that never waits forever on their build.

On a CPU, a tensor-parallel replica loads DeepSpeed's shared-memory all-reduce, a C++ op that
torch's extension builder compiles once and caches. By default that cache is the user's
(``~/.cache/torch_extensions``): shared by every checkout on the machine, each rebuilding it
over the others, and guarded by a lock file that a killed build leaves behind, after which
every start waits on it forever, silently. So the op lives in the environment's own folder
(``<sys.prefix>/torch_extensions``, what ``make setup`` builds into), and a lock that outlives
a build's time is reported with what to delete.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

# A build of the op takes 1-3 minutes on 2 cores; a lock older than this was left by a build
# that died.
BUILD_LOCK_TIMEOUT_SECONDS = 300.0


class StaleBuildLock(RuntimeError):
    """A DeepSpeed op's build lock outlived any build: its builder was killed."""


def extensions_dir() -> Path:
    """``TORCH_EXTENSIONS_DIR`` if the operator set it, else this environment's own folder."""
    configured = os.environ.get("TORCH_EXTENSIONS_DIR")
    return Path(configured) if configured else Path(sys.prefix) / "torch_extensions"


def use_own_extensions_dir() -> Path:
    """Point torch's extension builder (and so DeepSpeed) at ``extensions_dir()``."""
    folder = extensions_dir()
    os.environ["TORCH_EXTENSIONS_DIR"] = str(folder)
    return folder


def wait_for_build_locks(folder: Path, timeout: float = BUILD_LOCK_TIMEOUT_SECONDS) -> None:
    """Wait while another process builds an op under ``folder``; StaleBuildLock, naming the lock
    file, when one is still there after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while locks := sorted(folder.glob("*/*/lock")) + sorted(folder.glob("*/lock")):
        if time.monotonic() >= deadline:
            listed = " ".join(str(lock) for lock in locks)
            raise StaleBuildLock(
                f"A compiled op's build lock is still held after {timeout:.0f} s: a build was killed "
                f"while compiling. Delete it (rm {listed}) and start again, or rebuild with `make setup`."
            )
        time.sleep(1.0)
