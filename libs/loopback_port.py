"""A free TCP port on loopback, for a process about to listen there (rank rendezvous, tests, benches)."""

from __future__ import annotations

import random
import socket
import threading
from pathlib import Path

from cachet.config import LOOPBACK

# Ports handed out are drawn below the kernel's range for outgoing connections' own ports: one
# taken from that range (bind to port 0) can go to any process's next outgoing connection
# before the caller listens on it, which a loaded test run met as "Address already in use".
_LOWEST = 20000
_EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_handed_out: set[int] = set()
_lock = threading.Lock()


def free_loopback_port() -> int:
    """A port nothing listens on right now, not handed out before by this process; another
    process may still take it before the caller does."""
    highest = _first_ephemeral_port() - 1
    with _lock:
        for _ in range(200):
            port = random.randint(_LOWEST, highest) if highest > _LOWEST else 0
            if port in _handed_out:
                continue
            with socket.socket() as probe:
                try:
                    probe.bind((LOOPBACK, port))
                except OSError:
                    continue
                chosen = probe.getsockname()[1]
            _handed_out.add(chosen)
            return chosen
    raise OSError(f"no free loopback port found between {_LOWEST} and {highest}")


def _first_ephemeral_port() -> int:
    try:
        return int(_EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default
