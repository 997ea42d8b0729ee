"""A scripted KV event publisher for follower tests.

It implements only ``EngineService.StreamKvEvents`` and plays exactly the
batches a test hands it, so tests can produce what a real engine rarely does on
cue (gaps, a changed replica id, a stream ending). It is a double of the
contract, not of the engine: the end-to-end test runs the real engine process.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import grpc

from cachet.config import ServiceSettings
from cachet.engine.v1 import engine_pb2, engine_pb2_grpc
from cachet.grpc_server import RunningServer, create_server

MODEL = "tiny-llama"
_END = object()


# Tiers by the names the engine's events use; none (an engine older than the tiers) is the pool.
TIERS = {
    "engine": engine_pb2.KV_TIER_ENGINE,
    "host": engine_pb2.KV_TIER_HOST,
    "shared": engine_pb2.KV_TIER_SHARED,
}


def stored(hashes: list[int], parent: int | None = None, tier: str = "engine") -> engine_pb2.KvEvent:
    event = engine_pb2.BlocksStored(block_hashes=hashes)
    if parent is not None:
        event.parent_block_hash = parent
    return engine_pb2.KvEvent(stored=event, tier=TIERS[tier])


def removed(hashes: list[int], tier: str = "engine") -> engine_pb2.KvEvent:
    return engine_pb2.KvEvent(removed=engine_pb2.BlocksRemoved(block_hashes=hashes), tier=TIERS[tier])


def cleared(tier: str = "engine") -> engine_pb2.KvEvent:
    return engine_pb2.KvEvent(cleared=engine_pb2.AllBlocksCleared(), tier=TIERS[tier])


def batch(
    sequence_number: int, *events: engine_pb2.KvEvent, replica_id: str = "replica-1", model: str = MODEL
) -> engine_pb2.KvEventBatch:
    return engine_pb2.KvEventBatch(
        replica_id=replica_id, sequence_number=sequence_number, events=events, model=model, block_size=16
    )


class ScriptedKvEvents(engine_pb2_grpc.EngineServiceServicer):
    """Each subscription reads from its own queue; ``send`` feeds the newest one."""

    def __init__(self) -> None:
        self.queues: list[asyncio.Queue] = []

    @property
    def subscriptions(self) -> int:
        return len(self.queues)

    async def StreamKvEvents(self, request, context):
        queue: asyncio.Queue = asyncio.Queue()
        self.queues.append(queue)
        while (item := await queue.get()) is not _END:
            yield item

    def send(self, *batches: engine_pb2.KvEventBatch) -> None:
        for item in batches:
            self.queues[-1].put_nowait(item)

    def end_stream(self) -> None:
        self.queues[-1].put_nowait(_END)


async def start_scripted(port: int = 0) -> tuple[ScriptedKvEvents, RunningServer]:
    servicer = ScriptedKvEvents()

    def register(server: grpc.aio.Server) -> None:
        engine_pb2_grpc.add_EngineServiceServicer_to_server(servicer, server)

    running = await create_server(ServiceSettings(port=port), [register], ["cachet.engine.v1.EngineService"])
    return servicer, running


async def eventually(predicate: Callable[[], bool], timeout: float = 5.0, what: str = "condition") -> None:
    """Wait until ``predicate()`` holds; fail with ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        await asyncio.sleep(0.01)
