"""Entry point of the cache service: the index, its engine followers and the gRPC server."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from cachet.cache.followers import Followers
from cachet.cache.metrics import IndexCollector
from cachet.cache.prefix_index import PrefixIndex
from cachet.cache.servicer import CacheIndexServicer, registrar
from cachet.cache.settings import CacheSettings
from cachet.cache.v1 import cache_pb2
from cachet.grpc_server import RunningServer, create_server, serve_until_signalled
from cachet.logs import configure_logging, get_logger
from cachet.tracing import configure_tracing

log = get_logger(__name__)

SERVICE_NAME = cache_pb2.DESCRIPTOR.services_by_name["CacheIndexService"].full_name


@dataclass(kw_only=True)
class CacheServer(RunningServer):
    """The running server plus what must stop with it: the followers."""

    index: PrefixIndex
    followers: Followers

    async def stop(self, grace: float | None = 5.0) -> None:
        await super().stop(grace)
        await self.followers.stop_all()


async def start(settings: CacheSettings, *, metrics_port: int | None = None) -> CacheServer:
    """Serve the index on ``settings.port`` and follow every ``settings.engine_addresses``.

    ``metrics_port`` (0: a free one) also serves Prometheus figures over HTTP.
    """
    index = PrefixIndex()
    followers = Followers(index, tls=settings.tls)
    running = await create_server(
        settings,
        [registrar(CacheIndexServicer(index, followers))],
        [SERVICE_NAME],
        metrics_port=metrics_port,
        metrics_collectors=[IndexCollector(index, followers)],
    )
    for address in settings.engine_addresses:
        followers.watch(address)
    return CacheServer(
        server=running.server,
        port=running.port,
        health=running.health,
        service_names=running.service_names,
        metrics=running.metrics,
        index=index,
        followers=followers,
    )


async def _serve(settings: CacheSettings) -> None:
    running = await start(settings, metrics_port=settings.metrics_port or None)
    log.info("cache index serving", engines=settings.engine_addresses, metrics_port=running.metrics_port)
    await serve_until_signalled(running, settings.drain_seconds)


def main(port: int | None = None) -> None:
    settings = CacheSettings() if port is None else CacheSettings(port=port)
    configure_logging("cache", settings.log_level)
    configure_tracing("cache")
    asyncio.run(_serve(settings))
