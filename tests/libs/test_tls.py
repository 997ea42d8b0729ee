"""TLS and mutual TLS through the one server and channel factory, and the loopback-only plaintext rule."""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from pydantic import ValidationError
from tls_certs import TestPki

from cachet.bridge.settings import BridgeSettings
from cachet.config import ServiceSettings
from cachet.grpc_channel import create_channel
from cachet.grpc_server import create_server
from cachet.metrics_endpoint import serve_metrics, serve_metrics_or_go_without
from cachet.router.settings import RouterSettings
from cachet.tls import PlaintextRefused, TlsSettings, add_port, blocking_channel, http_client_context
from cachet.usage.settings import UsageSettings

PEER = "cachet.test.v1.Peer"


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> TestPki:
    return TestPki.create(tmp_path_factory.mktemp("pki"))


async def _serving(address: str, tls: TlsSettings | None) -> int:
    """The health status a client with ``tls`` gets, or the status code of its failure."""
    async with create_channel(address, tls=tls) as channel:
        try:
            reply = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=5
            )
        except grpc.aio.AioRpcError as error:
            return error.code()
    return reply.status


@pytest.fixture
async def tls_server(pki: TestPki):
    running = await create_server(ServiceSettings(port=0, tls=pki.server()), [], [])
    yield running
    await running.stop(grace=None)


@pytest.fixture
async def mtls_server(pki: TestPki):
    running = await create_server(ServiceSettings(port=0, tls=pki.server(client_auth=True)), [], [])
    yield running
    await running.stop(grace=None)


async def test_a_tls_server_answers_a_client_with_the_ca_and_refuses_plaintext(
    tls_server, pki: TestPki
) -> None:
    serving = health_pb2.HealthCheckResponse.SERVING
    assert await _serving(tls_server.address, pki.client(None)) == serving
    # The name checked is the address's host: the certificate names 127.0.0.1 and localhost.
    assert await _serving(f"localhost:{tls_server.port}", pki.client(None)) == serving
    assert await _serving(tls_server.address, None) == grpc.StatusCode.UNAVAILABLE
    # A client that trusts another CA does not talk to it either.
    assert await _serving(tls_server.address, TlsSettings(ca_file=pki.path("stranger"))) == (
        grpc.StatusCode.UNAVAILABLE
    )


async def test_mutual_tls_refuses_a_client_without_a_certificate_from_the_ca(
    mtls_server, pki: TestPki
) -> None:
    serving = health_pb2.HealthCheckResponse.SERVING
    assert await _serving(mtls_server.address, pki.client("client")) == serving
    # Services call each other with their own pair (CACHET_TLS_CERT_FILE), good for both ends.
    assert await _serving(mtls_server.address, pki.server()) == serving
    assert await _serving(mtls_server.address, pki.client(None)) == grpc.StatusCode.UNAVAILABLE
    assert await _serving(mtls_server.address, pki.client("stranger")) == grpc.StatusCode.UNAVAILABLE
    assert await _serving(mtls_server.address, None) == grpc.StatusCode.UNAVAILABLE


async def test_the_blocking_channel_of_probes_speaks_tls_too(tls_server, pki: TestPki) -> None:
    # run-local's health probes are synchronous; the server runs on this test's event loop,
    # so they call from a thread.
    def check(tls: TlsSettings | None) -> int:
        with blocking_channel(tls_server.address, tls) as channel:
            try:
                stub = health_pb2_grpc.HealthStub(channel)
                return stub.Check(health_pb2.HealthCheckRequest(), timeout=5).status
            except grpc.RpcError as error:
                return error.code()

    assert await asyncio.to_thread(check, pki.client(None)) == health_pb2.HealthCheckResponse.SERVING
    assert await asyncio.to_thread(check, None) == grpc.StatusCode.UNAVAILABLE


@pytest.mark.parametrize("host", ["0.0.0.0", "10.1.2.3", "example.com", "::"])
def test_plaintext_beyond_loopback_is_refused_unless_the_operator_allows_it(host: str, pki: TestPki) -> None:
    with pytest.raises(ValidationError, match="refuses to listen in plaintext .* CACHET_TLS_CERT_FILE"):
        RouterSettings(host=host)
    with pytest.raises(ValidationError, match="the bridge refuses to listen in plaintext"):
        BridgeSettings(host=host)
    assert RouterSettings(host=host, tls=pki.server()).tls.serves_tls
    assert RouterSettings(host=host, tls=TlsSettings(allow_plaintext=True)).host == host


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2", "::1", "localhost"])
def test_plaintext_on_loopback_needs_nothing(host: str) -> None:
    assert not RouterSettings(host=host).tls.serves_tls


async def test_the_server_refuses_plaintext_beyond_loopback_even_from_unvalidated_settings() -> None:
    # model_copy(update=...) skips validation: the bind checks again.
    settings = ServiceSettings(port=0).model_copy(update={"host": "0.0.0.0"})
    server = grpc.aio.server()
    with pytest.raises(PlaintextRefused):
        add_port(server, settings.host, settings.port, settings.tls)
    with pytest.raises(PlaintextRefused):
        await create_server(settings, [], [])


def test_every_service_reads_the_shared_variables(monkeypatch: pytest.MonkeyPatch, pki: TestPki) -> None:
    for name, value in pki.env(client_auth=True).items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("CACHET_ROUTER_HOST", "0.0.0.0")
    router = RouterSettings()
    assert router.tls == pki.server(client_auth=True)
    assert BridgeSettings().tls.client_auth
    # A plain settings object handed on (bridge, tests) keeps its TLS.
    assert RouterSettings(**router.model_dump()).tls == router.tls


def test_half_configured_tls_is_refused_when_read(pki: TestPki) -> None:
    with pytest.raises(ValidationError, match="set together"):
        TlsSettings(cert_file=pki.path("server"))
    with pytest.raises(ValidationError, match="set together"):
        TlsSettings(client_key_file=pki.path("client", "key"), ca_file=pki.path("ca"))
    with pytest.raises(ValidationError, match="CACHET_TLS_CLIENT_AUTH needs"):
        TlsSettings(cert_file=pki.path("server"), key_file=pki.path("server", "key"), client_auth=True)


def _scrape(url: str, tls: TlsSettings | None) -> int:
    """The status of GET ``url`` by a client with ``tls`` (None: no TLS at all)."""
    verify = http_client_context(tls) if tls is not None else True
    return httpx.get(url, verify=verify, timeout=5).status_code


async def test_metrics_serve_https_with_the_services_certificate_and_refuse_plain_http(pki: TestPki) -> None:
    running = await create_server(ServiceSettings(port=0, tls=pki.server()), [], [], metrics_port=0)
    try:
        port = running.metrics_port
        assert running.metrics is not None and running.metrics.url.startswith("https://")
        # A client that connects and never speaks holds only its own connection's thread.
        with socket.create_connection(("127.0.0.1", port)):
            reply = await asyncio.to_thread(
                httpx.get,
                f"https://127.0.0.1:{port}/metrics",
                verify=http_client_context(pki.client(None)),
                timeout=5,
            )
            assert reply.status_code == 200
            assert "process_cpu_seconds_total" in reply.text
        with pytest.raises(httpx.TransportError):
            await asyncio.to_thread(_scrape, f"http://127.0.0.1:{port}/metrics", None)
        with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
            await asyncio.to_thread(
                _scrape, f"https://127.0.0.1:{port}/metrics", TlsSettings(ca_file=pki.path("stranger"))
            )
    finally:
        await running.stop(grace=None)


async def test_metrics_under_mutual_tls_ask_the_scraper_for_a_certificate(pki: TestPki) -> None:
    running = await create_server(
        ServiceSettings(port=0, tls=pki.server(client_auth=True)), [], [], metrics_port=0
    )
    try:
        url = f"https://localhost:{running.metrics_port}/metrics"
        # Prometheus presents its own certificate from the CA (its scrape's tls_config).
        assert await asyncio.to_thread(_scrape, url, pki.client("client")) == 200
        for refused in (pki.client(None), pki.client("stranger")):
            with pytest.raises(httpx.TransportError):
                await asyncio.to_thread(_scrape, url, refused)
    finally:
        await running.stop(grace=None)


@pytest.mark.parametrize("host", ["0.0.0.0", "10.1.2.3"])
def test_plaintext_metrics_beyond_loopback_are_refused_like_grpc(host: str, pki: TestPki) -> None:
    with pytest.raises(PlaintextRefused, match="metrics endpoint refuses to listen in plaintext"):
        serve_metrics(0, host, tls=TlsSettings(allow_plaintext=False))
    with pytest.raises(PlaintextRefused):
        serve_metrics_or_go_without(0, host, tls=TlsSettings(allow_plaintext=False))


def test_a_service_presents_its_own_identity_where_it_has_one(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    pki = TestPki.create(tmp_path, identities=("router",))
    for name, value in pki.env(client_auth=True).items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("CACHET_ROUTER_TLS_CERT_FILE", str(pki.path("router")))
    monkeypatch.setenv("CACHET_ROUTER_TLS_KEY_FILE", str(pki.path("router", "key")))
    # The router's pair replaces the shared one; the CA and mTLS stay shared, as do other services'.
    assert RouterSettings().tls == pki.server(client_auth=True, stem="router")
    assert UsageSettings().tls == pki.server(client_auth=True)
    # Handed on as a plain settings object, it keeps the identity it was read with.
    assert RouterSettings(**RouterSettings().model_dump()).tls.cert_file == pki.path("router")
    monkeypatch.delenv("CACHET_ROUTER_TLS_KEY_FILE")
    with pytest.raises(ValidationError, match="CACHET_ROUTER_TLS_CERT_FILE and CACHET_ROUTER_TLS_KEY_FILE"):
        RouterSettings()


async def _peer_name(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
    return context.auth_context()["x509_common_name"][0]


def _register_peer_name(server: grpc.aio.Server) -> None:
    handler = grpc.unary_unary_rpc_method_handler(_peer_name, lambda b: b, lambda b: b)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(PEER, {"Name": handler}),))


async def test_a_client_authenticating_service_accepts_any_identity_the_ca_signed(tmp_path: Path) -> None:
    """The usage service under its own identity, called by the router under its own: the CA is
    what is checked, not which service the certificate names (there is no peer allow-list)."""
    pki = TestPki.create(tmp_path, identities=("router", "usage"))
    usage = pki.server(client_auth=True, stem="usage")
    running = await create_server(
        ServiceSettings(port=0, tls=usage), [_register_peer_name], [PEER], metrics_port=0
    )
    try:
        async with create_channel(running.address, tls=pki.server(stem="router")) as channel:
            assert await channel.unary_unary(f"/{PEER}/Name")(b"", timeout=5) == b"cachet router"
        # It serves under its own name too (its /metrics port, with the same pair).
        context = http_client_context(pki.server(stem="router"))

        def served_name() -> str:
            with (
                socket.create_connection(("127.0.0.1", running.metrics_port), timeout=5) as raw,
                context.wrap_socket(raw, server_hostname="127.0.0.1") as secured,
            ):
                subject = dict(pair for rdn in secured.getpeercert()["subject"] for pair in rdn)
                return subject["commonName"]

        assert await asyncio.to_thread(served_name) == "cachet usage"
    finally:
        await running.stop(grace=None)
