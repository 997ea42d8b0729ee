"""Follows one engine's KV event stream and mirrors it into the prefix index.

One asyncio task per engine address, for the life of the cache service:

    subscribe -> apply batches in order -> (stream ends or breaks) -> forget -> back off -> subscribe

The contract (engine.proto ``StreamKvEvents``): each subscription starts with a
snapshot of every cached block as "stored" events, then live events in order,
batches numbered from 0 with no gaps, all under one ``replica_id``. So whatever
goes wrong, the fix is the same: drop the replica's blocks and resubscribe; the
next snapshot rebuilds them exactly.

The replica is forgotten the moment its stream ends, not when a reconnect
fails: a router must never send a request to a dead replica because the index
still says it holds the prefix.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import grpc

from cachet.cache.backoff import Backoff
from cachet.cache.prefix_index import PrefixIndex, Tier
from cachet.engine.v1 import engine_pb2, engine_pb2_grpc
from cachet.grpc_channel import create_channel
from cachet.logs import get_logger
from cachet.tls import TlsSettings

log = get_logger(__name__)

# An engine older than the tiers sends no tier: KV_TIER_ENGINE, all it had.
_TIERS: dict[int, Tier] = {
    engine_pb2.KV_TIER_ENGINE: "engine",
    engine_pb2.KV_TIER_HOST: "host",
    engine_pb2.KV_TIER_SHARED: "shared",
}


@dataclass
class FollowerStatus:
    """What ListReplicas reports about one followed engine."""

    address: str
    # The engine's replica id on the current subscription; "" while disconnected.
    replica_id: str = ""
    # True from the first batch of a subscription until that subscription ends.
    connected: bool = False
    # Last batch applied on the current (or last) subscription.
    last_sequence_number: int = 0
    block_size: int = 0
    # Subscriptions opened so far (the first one included).
    subscriptions: int = 0


class StreamOutOfSync(Exception):
    """The stream broke its own contract (gap, new replica id or model): resubscribe."""


class ReplicaFollower:
    """Mirrors one engine's cached blocks into ``index`` under the engine's address."""

    def __init__(
        self,
        address: str,
        index: PrefixIndex,
        backoff: Backoff | None = None,
        *,
        tls: TlsSettings | None = None,
    ) -> None:
        self.address = address
        self._tls = tls
        self.status = FollowerStatus(address)
        self._index = index
        self._backoff = backoff or Backoff()
        # Model named by the current subscription's first batch.
        self._model = ""
        self._channel: grpc.aio.Channel | None = None
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self._task is None:
            self._channel = create_channel(self.address, tls=self._tls)
            self._task = asyncio.create_task(self._run(), name=f"follow-kv-events {self.address}")

    async def stop(self) -> None:
        """Cancel the stream, forget the replica and close the channel."""
        if self._task is not None:
            self._task.cancel()
            # Gather (not await) so the cancellation we caused is not re-raised here.
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        self._disconnected()
        if self._channel is not None:
            await self._channel.close()
            self._channel = None

    async def _run(self) -> None:
        assert self._channel is not None
        stub = engine_pb2_grpc.EngineServiceStub(self._channel)
        while True:
            try:
                await self._follow_once(stub)
                reason = "stream ended"
            except StreamOutOfSync as out_of_sync:
                reason = str(out_of_sync)
            except grpc.aio.AioRpcError as error:
                reason = f"{error.code().name}: {error.details()}"
            except Exception:  # noqa: BLE001 - a follower that dies silently is an outage nobody sees
                log.exception("kv event follower failed", engine=self.address)
                reason = "follower error"
            was_connected = self.status.connected
            self._disconnected()
            delay = self._backoff.next_delay()
            # Warn when a live stream is lost; retries against an engine that stays down are routine.
            report = log.warning if was_connected else log.debug
            report("kv event stream down", engine=self.address, reason=reason, retry_in_s=round(delay, 3))
            await asyncio.sleep(delay)

    async def _follow_once(self, stub: engine_pb2_grpc.EngineServiceAsyncStub) -> None:
        """One subscription: returns when the engine ends the stream, raises when it breaks."""
        self.status.subscriptions += 1
        call = stub.StreamKvEvents(engine_pb2.StreamKvEventsRequest())
        try:
            async for batch in call:
                self._apply(batch)
        finally:
            call.cancel()

    def _apply(self, batch: engine_pb2.KvEventBatch) -> None:
        if not self.status.connected:
            self._connected(batch)
        else:
            self._check_in_sync(batch)
        for event in batch.events:
            kind = event.WhichOneof("event")
            tier = _TIERS.get(event.tier)
            if tier is None:
                # A tier this index does not know (a newer engine): better unmirrored than misfiled.
                continue
            if kind == "stored":
                self._index.apply_stored(self.address, batch.model, event.stored.block_hashes, tier)
            elif kind == "removed":
                self._index.apply_removed(self.address, event.removed.block_hashes, tier)
            elif kind == "cleared":
                self._index.clear(self.address, tier)
        self.status.last_sequence_number = batch.sequence_number

    def _connected(self, first: engine_pb2.KvEventBatch) -> None:
        if first.sequence_number != 0:
            raise StreamOutOfSync(f"subscription started at batch {first.sequence_number}, not 0")
        # Whatever a previous subscription left must already be gone; the snapshot rebuilds it.
        self._index.forget_replica(self.address)
        self.status.connected = True
        self.status.replica_id = first.replica_id
        self.status.block_size = first.block_size
        self._model = first.model
        # Before the snapshot's events: its shared blocks go to the folder's group.
        self._index.join_shared_group(self.address, first.model, first.shared_tier_id)
        # A stream that delivered its snapshot is healthy: the next failure starts from a short delay.
        self._backoff.reset()
        log.info("following kv events", engine=self.address, replica_id=first.replica_id, model=first.model)

    def _check_in_sync(self, batch: engine_pb2.KvEventBatch) -> None:
        expected = self.status.last_sequence_number + 1
        if batch.sequence_number != expected:
            raise StreamOutOfSync(f"gap in kv events: got batch {batch.sequence_number}, expected {expected}")
        if batch.replica_id != self.status.replica_id:
            raise StreamOutOfSync(f"replica id changed from {self.status.replica_id} to {batch.replica_id}")
        if batch.model != self._model:
            raise StreamOutOfSync(f"model changed from {self._model!r} to {batch.model!r}")

    def _disconnected(self) -> None:
        self._index.forget_replica(self.address)
        self.status.connected = False
        self.status.replica_id = ""
