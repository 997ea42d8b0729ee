"""Whether a launcher made this process one rank of a group: read from the environment
alone, so the engine can ask before it imports torch (``core_process.launch_early``)."""

from __future__ import annotations

import os


def externally_launched() -> bool:
    """True when a launcher (deepspeed, torchrun) made this process one rank of a group."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1 and "RANK" in os.environ
