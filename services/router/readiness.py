"""The router's readiness on gRPC health, beside its liveness.

The overall status (service ``""``) says the router is up: it serves, and takes queued work,
before any engine has reported. Service ``READINESS_SERVICE`` says a request can be served
now: SERVING while some engine replica serves a model (what ListModels lists), NOT_SERVING
otherwise, as the bridge's ``/ready`` does over REST. A probe that waits for traffic to be
served asks for that name.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

from grpc_health.v1 import health, health_pb2

READINESS_SERVICE = "cachet.router.Readiness"
_POLL_SECONDS = 0.25


class ReadinessPublisher:
    def __init__(
        self, health_servicer: health.aio.HealthServicer, serves_a_model: Callable[[], bool]
    ) -> None:
        self._health = health_servicer
        self._serves_a_model = serves_a_model
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="router-readiness")

    async def stop(self) -> None:
        """Stop publishing and say NOT_SERVING (the router is going away)."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await self._health.set(READINESS_SERVICE, health_pb2.HealthCheckResponse.NOT_SERVING)

    async def _run(self) -> None:
        published = None
        while True:
            status = (
                health_pb2.HealthCheckResponse.SERVING
                if self._serves_a_model()
                else health_pb2.HealthCheckResponse.NOT_SERVING
            )
            if status != published:
                await self._health.set(READINESS_SERVICE, status)
                published = status
            await asyncio.sleep(_POLL_SECONDS)
