"""A service's Prometheus /metrics endpoint: an HTTP server on a port of its own, in a thread.

Every gRPC service serves one by default (``CACHET_<SERVICE>_METRICS_PORT``, 0 turns it off;
a port it cannot bind leaves it serving without one, see ``serve_metrics_or_go_without``);
the bridge serves /metrics on its REST port instead. What it serves is the process-wide
registry (the gRPC server's figures, process CPU and memory, the service's own module-level
metrics) plus the collectors a service passes in: figures read from its objects at scrape
time, kept out of the global registry so tests can build those objects many times.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from wsgiref.simple_server import WSGIServer

from prometheus_client import REGISTRY, CollectorRegistry, start_http_server
from prometheus_client.core import Metric
from prometheus_client.registry import Collector

from cachet.config import LOOPBACK
from cachet.logs import get_logger

log = get_logger(__name__)


class _ProcessWide(Collector):
    """The global registry's figures, inside another registry (no ``describe``: the registry
    then reads no names from it, so nothing in it can clash with the service's collectors)."""

    def collect(self) -> Iterator[Metric]:
        yield from REGISTRY.collect()


@dataclass
class MetricsEndpoint:
    """A running /metrics server; the owner stops it (``stop``) when its service stops."""

    server: WSGIServer

    @property
    def port(self) -> int:
        return self.server.server_port

    @property
    def url(self) -> str:
        # An AF_INET server's host is a str; typeshed's TCPServer also allows bytes.
        return f"http://{self.server.server_address[0]}:{self.port}/metrics"  # type: ignore[str-bytes-safe]

    async def stop(self) -> None:
        # shutdown() blocks until the serving thread notices; keep it off the event loop.
        await asyncio.to_thread(self.server.shutdown)
        self.server.server_close()


def serve_metrics(port: int, host: str = LOOPBACK, collectors: Iterable[Collector] = ()) -> MetricsEndpoint:
    """Serve /metrics on ``host:port`` (0: a free port): the process-wide registry and ``collectors``."""
    registry = CollectorRegistry()
    registry.register(_ProcessWide())
    for collector in collectors:
        registry.register(collector)
    server, _thread = start_http_server(port, addr=host, registry=registry)
    return MetricsEndpoint(server)


def serve_metrics_or_go_without(
    port: int, host: str = LOOPBACK, collectors: Iterable[Collector] = (), *, chosen: bool = True
) -> MetricsEndpoint | None:
    """``serve_metrics``, or, when the port cannot be had, none: a service serves without
    /metrics rather than failing to start (or, restarted by a supervisor, failing again and
    again) over the port of its figures. A service's default port may simply be another
    process's (a second replica, another checkout's services on a shared box): a warning. A
    port someone ``chosen`` that another process took (run-local's free ports are free when
    planned, and a slow engine binds its own a minute later): an error, which the scrape's
    target going down shows too."""
    try:
        return serve_metrics(port, host, collectors)
    except OSError as taken:
        report = log.error if chosen else log.warning
        report(
            "metrics port not available: serving without /metrics (set the service's METRICS_PORT)",
            metrics_port=port,
            error=str(taken),
        )
        return None
