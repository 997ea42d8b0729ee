"""A service's Prometheus /metrics endpoint: an HTTP server on a port of its own, in a thread.

Every gRPC service serves one by default (``CACHET_<SERVICE>_METRICS_PORT``, 0 turns it off;
a port it cannot bind leaves it serving without one, see ``serve_metrics_or_go_without``);
the bridge serves /metrics on its REST port instead. What it serves is the process-wide
registry (the gRPC server's figures, process CPU and memory, the service's own module-level
metrics) plus the collectors a service passes in: figures read from its objects at scrape
time, kept out of the global registry so tests can build those objects many times.

It follows the service's TLS settings (``cachet.tls``): with a certificate it serves HTTPS with
it, and under ``CACHET_TLS_CLIENT_AUTH`` it asks every scraper for a certificate from the CA as
the gRPC port does (Prometheus presents its own, ``tls_config`` in
deploy/prometheus/scrape-config.yaml): the fleet's models, load and cost are not for anyone
who can reach the port. Without one it refuses to listen beyond loopback, as the gRPC port
does, unless ``CACHET_TLS_ALLOW_PLAINTEXT``.
"""

from __future__ import annotations

import asyncio
import socket
import ssl
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import REGISTRY, CollectorRegistry, make_wsgi_app
from prometheus_client.core import Metric
from prometheus_client.exposition import ThreadingWSGIServer
from prometheus_client.registry import Collector

from cachet.config import LOOPBACK
from cachet.logs import get_logger
from cachet.tls import TlsSettings, check_listener, server_ssl_context

log = get_logger(__name__)

# How long a scraper has to finish its TLS handshake, and then each read of its request.
_CLIENT_TIMEOUT_SECONDS = 10.0


class _ProcessWide(Collector):
    """The global registry's figures, inside another registry (no ``describe``: the registry
    then reads no names from it, so nothing in it can clash with the service's collectors)."""

    def collect(self) -> Iterator[Metric]:
        yield from REGISTRY.collect()


class _Server(ThreadingWSGIServer):
    """prometheus_client's threaded WSGI server (a thread per connection), with TLS set up in
    that connection's thread. prometheus_client's own TLS wraps the listening socket instead,
    so every handshake runs inside ``accept()`` on the one serving thread: a client that
    connects and says nothing (a port scan, a TCP probe) would hold every later scrape, and
    ``stop()``, behind it."""

    ssl_context: ssl.SSLContext | None = None

    def finish_request(self, request: Any, client_address: Any) -> None:
        if self.ssl_context is None:
            super().finish_request(request, client_address)
            return
        request.settimeout(_CLIENT_TIMEOUT_SECONDS)
        try:
            secured = self.ssl_context.wrap_socket(request, server_side=True)
        except OSError as refused:  # ssl.SSLError and timeouts: this client's failure, not the server's
            log.debug("metrics handshake failed", client=client_address[0], error=str(refused))
            return
        with secured:
            super().finish_request(secured, client_address)


class _Server6(_Server):
    address_family = socket.AF_INET6


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (the base class's name)
        """A scrape every few seconds is not news."""


@dataclass
class MetricsEndpoint:
    """A running /metrics server; the owner stops it (``stop``) when its service stops."""

    server: WSGIServer

    @property
    def port(self) -> int:
        return self.server.server_port

    @property
    def scheme(self) -> str:
        return "http" if getattr(self.server, "ssl_context", None) is None else "https"

    @property
    def url(self) -> str:
        # An AF_INET server's host is a str; typeshed's TCPServer also allows bytes.
        return f"{self.scheme}://{self.server.server_address[0]}:{self.port}/metrics"  # type: ignore[str-bytes-safe]

    async def stop(self) -> None:
        # shutdown() blocks until the serving thread notices; keep it off the event loop.
        await asyncio.to_thread(self.server.shutdown)
        self.server.server_close()


def serve_metrics(
    port: int, host: str = LOOPBACK, collectors: Iterable[Collector] = (), *, tls: TlsSettings
) -> MetricsEndpoint:
    """Serve /metrics on ``host:port`` (0: a free port): the process-wide registry and
    ``collectors``; over HTTPS when ``tls`` has a certificate, refused (``PlaintextRefused``)
    beyond loopback without one unless it allows plaintext."""
    context = _context(host, tls)
    return _bind(port, host, _registry(collectors), context)


def serve_metrics_or_go_without(
    port: int,
    host: str = LOOPBACK,
    collectors: Iterable[Collector] = (),
    *,
    tls: TlsSettings,
    chosen: bool = True,
) -> MetricsEndpoint | None:
    """``serve_metrics``, or, when the port cannot be had, none: a service serves without
    /metrics rather than failing to start (or, restarted by a supervisor, failing again and
    again) over the port of its figures. A service's default port may simply be another
    process's (a second replica, another checkout's services on a shared box): a warning. A
    port someone ``chosen`` that another process took (run-local's free ports are free when
    planned, and a slow engine binds its own a minute later): an error, which the scrape's
    target going down shows too. Plaintext beyond loopback and unreadable certificates still
    fail the start: those are not a neighbour's doing."""
    context = _context(host, tls)
    try:
        return _bind(port, host, _registry(collectors), context)
    except OSError as taken:
        report = log.error if chosen else log.warning
        report(
            "metrics port not available: serving without /metrics (set the service's METRICS_PORT)",
            metrics_port=port,
            error=str(taken),
        )
        return None


def _context(host: str, tls: TlsSettings) -> ssl.SSLContext | None:
    check_listener(host, tls, "metrics endpoint")
    return server_ssl_context(tls) if tls.serves_tls else None


def _registry(collectors: Iterable[Collector]) -> CollectorRegistry:
    registry = CollectorRegistry()
    registry.register(_ProcessWide())
    for collector in collectors:
        registry.register(collector)
    return registry


def _bind(
    port: int, host: str, registry: CollectorRegistry, context: ssl.SSLContext | None
) -> MetricsEndpoint:
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    server_class = _Server6 if family == socket.AF_INET6 else _Server
    server = make_server(host, port, make_wsgi_app(registry), server_class, handler_class=_QuietHandler)
    assert isinstance(server, _Server)
    server.ssl_context = context
    threading.Thread(target=server.serve_forever, name="metrics", daemon=True).start()
    return MetricsEndpoint(server)
