"""A free TCP port on loopback, for a process about to listen there (rank rendezvous, tests, benches)."""

from __future__ import annotations

import socket

from cachet.config import LOOPBACK


def free_loopback_port() -> int:
    """A port nothing listens on right now; another process may still take it before the caller does."""
    with socket.socket() as probe:
        probe.bind((LOOPBACK, 0))
        return probe.getsockname()[1]
