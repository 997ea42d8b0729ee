"""The engine replicas: what each serves, how busy it is, whether it is up.

Per engine address one background task asks ``GetEngineInfo`` and then follows
``StreamLoadReports``, keeping only the latest report. A replica is *available*
while that stream is up and its last report is fresh (younger than
``stale_seconds``, measured on the router's own monotonic clock so that clock skew
between machines does not matter). When the stream fails the task reconnects with
capped exponential backoff; until it does, placement does not see the replica.

Load reports lag by up to one interval, so requests placed in a burst would all
see the same numbers. The router therefore also counts the requests it has itself
in flight on each replica, and placement uses the larger of the two counts: exact
for a single router, and never below what the engine reports for several routers.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import grpc

from cachet.common.v1 import common_pb2
from cachet.engine.v1 import engine_pb2, engine_pb2_grpc
from cachet.grpc_channel import create_channel
from cachet.logs import get_logger
from cachet.router.placement import ReplicaLoad
from cachet.tls import TlsSettings

log = get_logger(__name__)

_MIN_BACKOFF_SECONDS = 0.1
_MAX_BACKOFF_SECONDS = 2.0
_INFO_TIMEOUT_SECONDS = 5.0


def estimated_load(
    address: str,
    report: engine_pb2.LoadReport,
    in_flight: int,
    in_flight_batch: int = 0,
    *,
    in_flight_at_report: int | None = None,
    in_flight_batch_at_report: int | None = None,
) -> ReplicaLoad:
    """The replica's load now: the report's requests that are not ours, plus ours in flight now.

    Of ours, the report can count at most those in flight when it arrived
    (``in_flight_at_report``; by default, all of ours now); the rest of its requests are
    other routers'. Counting the report's figures and ours side by side counted a request of
    ours twice: one the engine had queued but not yet seated when it reported (0 running,
    1 waiting) read as a full one-seat replica. Requests fill the seats first, interactive
    before batch (the engine preempts a queued job to seat an interactive request), then
    wait; ``in_flight_batch`` of ours are queued jobs.
    """
    ours_at_report = in_flight if in_flight_at_report is None else in_flight_at_report
    batch_at_report = in_flight_batch if in_flight_batch_at_report is None else in_flight_batch_at_report
    others = max(0, report.running_requests + report.waiting_requests - ours_at_report)
    others_batch = max(0, report.running_batch_requests + report.waiting_batch_requests - batch_at_report)
    total = others + in_flight
    batch = min(total, others_batch + in_flight_batch)
    max_running = report.max_running_requests
    running = min(total, max_running) if max_running else total
    batch_running = running - min(total - batch, running)
    return ReplicaLoad(
        address,
        running,
        total - running,
        max_running,
        report.max_waiting_requests,
        batch_running,
        batch - batch_running,
    )


@dataclass
class _Latest:
    """The newest report of one replica and when it arrived (monotonic seconds)."""

    report: engine_pb2.LoadReport
    received_at: float
    # This router's requests (and of them queued jobs) in flight when it arrived: the most of
    # them the report can count.
    in_flight: int = 0
    in_flight_batch: int = 0


class Replica:
    """One engine address: its channel, its facts and its latest load."""

    def __init__(
        self, address: str, stale_seconds: float, report_interval_ms: int, tls: TlsSettings | None = None
    ) -> None:
        self.address = address
        self.channel = create_channel(address, tls=tls)
        self.stub = engine_pb2_grpc.EngineServiceStub(self.channel)
        self.info: engine_pb2.EngineInfo | None = None
        # Unix time the current engine process was first seen (ListModels' "created").
        self.loaded_at = 0.0
        # This router's requests on the replica now, and of them the queued jobs.
        self.in_flight = 0
        self.in_flight_batch = 0
        self._stale_seconds = stale_seconds
        self._interval_ms = report_interval_ms
        self._latest: _Latest | None = None
        self._reported = asyncio.Event()

    def available(self, now: float | None = None) -> bool:
        if self.info is None or self._latest is None:
            return False
        now = time.monotonic() if now is None else now
        return now - self._latest.received_at <= self._stale_seconds

    def load(self) -> ReplicaLoad:
        """Placement's view; only meaningful while ``available()``."""
        assert self._latest is not None
        return estimated_load(
            self.address,
            self._latest.report,
            self.in_flight,
            self.in_flight_batch,
            in_flight_at_report=self._latest.in_flight,
            in_flight_batch_at_report=self._latest.in_flight_batch,
        )

    def enter(self, priority: common_pb2.Priority.ValueType) -> None:
        """One of this router's requests is now on the replica."""
        self.in_flight += 1
        if priority == common_pb2.PRIORITY_BATCH:
            self.in_flight_batch += 1

    def leave(self, priority: common_pb2.Priority.ValueType) -> None:
        self.in_flight -= 1
        if priority == common_pb2.PRIORITY_BATCH:
            self.in_flight_batch -= 1

    def latest_report(self) -> engine_pb2.LoadReport | None:
        """The newest load report as the engine sent it (None before the first); see ``available()``."""
        return self._latest.report if self._latest is not None else None

    def report_received_at(self) -> float:
        """When the latest report arrived (monotonic seconds; 0 before the first)."""
        return self._latest.received_at if self._latest is not None else 0.0

    def in_flight_at_report(self) -> int:
        """``in_flight`` when the latest report arrived; ours that ended since still show in it."""
        return self._latest.in_flight if self._latest is not None else 0

    async def wait_reported(self) -> None:
        await self._reported.wait()

    async def follow(self) -> None:
        """Keep the info and the latest report current until cancelled."""
        backoff = _MIN_BACKOFF_SECONDS
        while True:
            try:
                await self._subscribe()
            except grpc.aio.AioRpcError as error:
                log.warning("engine load stream failed", address=self.address, code=error.code().name)
            except Exception:  # noqa: BLE001 - this loop is the replica's only watcher: it must outlive a bug
                log.exception("engine load stream broke", address=self.address)
            self._latest = None
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, _MAX_BACKOFF_SECONDS)

    async def _refresh_info(self) -> None:
        info = await self.stub.GetEngineInfo(engine_pb2.GetEngineInfoRequest(), timeout=_INFO_TIMEOUT_SECONDS)
        if self.info is None or info.replica_id != self.info.replica_id:
            self.loaded_at = time.time()
        self.info = info

    async def _subscribe(self) -> None:
        await self._refresh_info()
        assert self.info is not None
        call = self.stub.StreamLoadReports(engine_pb2.StreamLoadReportsRequest(interval_ms=self._interval_ms))
        try:
            async for report in call:
                if report.replica_id != self.info.replica_id:
                    # The engine restarted behind the same address: its facts may have changed.
                    await self._refresh_info()
                self._latest = _Latest(report, time.monotonic(), self.in_flight, self.in_flight_batch)
                self._reported.set()
        finally:
            call.cancel()
        log.warning("engine load stream ended", address=self.address)


class ReplicaSet:
    """Every configured engine replica, followed in the background."""

    def __init__(
        self,
        addresses: list[str],
        stale_seconds: float = 5.0,
        report_interval_ms: int = 0,
        *,
        tls: TlsSettings | None = None,
    ) -> None:
        self._replicas = {
            address: Replica(address, stale_seconds, report_interval_ms, tls) for address in addresses
        }
        self._tasks: list[asyncio.Task[None]] = []

    def start(self) -> None:
        self._tasks = [asyncio.create_task(replica.follow()) for replica in self._replicas.values()]

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for replica in self._replicas.values():
            await replica.channel.close()

    async def wait_all_reported(self, timeout: float) -> bool:
        """Wait (bounded) until every replica has reported once; False on timeout."""
        waits = [replica.wait_reported() for replica in self._replicas.values()]
        try:
            await asyncio.wait_for(asyncio.gather(*waits), timeout)
        except TimeoutError:
            return False
        return True

    @property
    def addresses(self) -> list[str]:
        return list(self._replicas)

    def get(self, address: str) -> Replica:
        return self._replicas[address]

    def available(self, model: str | None = None, *, role: str = "") -> list[Replica]:
        """Replicas up right now, optionally only those serving ``model``. By default those that
        take whole requests (mixed and decode); ``role="prefill"``: the prefill replicas, which
        take prompts to hand off only (prefill_handoff)."""
        now = time.monotonic()
        return [
            replica
            for replica in self._replicas.values()
            if replica.available(now)
            and (model is None or replica.info.model == model)  # type: ignore[union-attr]
            and (replica.info.role == "prefill") == (role == "prefill")  # type: ignore[union-attr]
        ]

    def addresses_serving(self, model: str) -> list[str]:
        """Configured replicas last known to serve ``model``, up or not (a session's home set)."""
        return [r.address for r in self._replicas.values() if r.info is not None and r.info.model == model]

    def reproducible_kernels_serving(self, model: str) -> set[str]:
        """The batch-invariant kernels (``EngineInfo.reproducible_kernels``) of the replicas last
        known to serve ``model``: one value where every host is of one kind."""
        return {
            r.info.reproducible_kernels
            for r in self._replicas.values()
            if r.info is not None and r.info.model == model
        }

    def engine_info(self, model: str) -> engine_pb2.EngineInfo | None:
        """Facts of some replica serving ``model`` (replicas of one model share them)."""
        for replica in self._replicas.values():
            if replica.info is not None and replica.info.model == model:
                return replica.info
        return None

    def models(self) -> list[tuple[engine_pb2.EngineInfo, float]]:
        """Per model served by an available replica: its facts and when it was first loaded."""
        seen: dict[str, tuple[engine_pb2.EngineInfo, float]] = {}
        for replica in self.available():
            assert replica.info is not None
            info, loaded_at = seen.get(replica.info.model, (replica.info, replica.loaded_at))
            seen[info.model] = (info, min(loaded_at, replica.loaded_at))
        return list(seen.values())
