"""Keep the garbage collector off what a process built before it started serving.

A full (generation 2) collection walks every tracked object. In a service that has
imported torch, transformers, grpc and pydantic, and loaded a model, that is a few
hundred thousand objects that never die. Through a quick queue bench on the 2-core
dev box (a ``gc.callbacks`` recorder in every process), full collections while
serving took about 250 ms in the engine server and the engine loop process (one or
two a run) and 53-120 ms in the router (one every 10-20 s); every request in flight
in that process waits for each, which is how p99 latency gets spikes in it.
``gc.freeze()`` moves the objects alive at that point into a permanent generation
that collections skip; objects made while serving (requests, their messages) are
still collected as before.
"""

from __future__ import annotations

import gc

_frozen = False


def freeze_startup_heap() -> None:
    """Collect what startup left as garbage, then freeze everything still alive.

    For when the process is about to serve; only the first call freezes (a test
    process starts many in-process servers). Frozen objects are still freed by
    reference counting, but cycles among them never are: freezing garbage would
    keep it for the life of the process.
    """
    global _frozen
    if _frozen:
        return
    _frozen = True
    gc.collect()
    gc.freeze()
