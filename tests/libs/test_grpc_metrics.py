"""Every call a server answers is counted by method and by the status it ended with, and the
server's /metrics endpoint serves the counts (and stops with the server)."""

from __future__ import annotations

import socket

import grpc
import pytest
from metrics_scrape import naming_problems, scrape
from prometheus_client import REGISTRY, generate_latest

from cachet.config import LOOPBACK, ServiceSettings
from cachet.errors import InvalidArgument, ResourceExhausted
from cachet.grpc_channel import create_channel
from cachet.grpc_server import create_server
from cachet.usage.settings import UsageSettings

SERVICE = "cachet.test.v1.Counted"


def _identity(data: bytes) -> bytes:
    return data


async def _unary(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
    if request == b"bad":
        raise InvalidArgument("no")
    if request == b"bug":
        raise KeyError("bug")
    return request


async def _stream(request: bytes, context: grpc.aio.ServicerContext):
    yield b"one"
    if request == b"busy":
        raise ResourceExhausted("full", retry_after_seconds=1)
    yield b"two"


def _register(server: grpc.aio.Server) -> None:
    handlers = {
        "Unary": grpc.unary_unary_rpc_method_handler(_unary, _identity, _identity),
        "Stream": grpc.unary_stream_rpc_method_handler(_stream, _identity, _identity),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))


def handled(method: str, code: str) -> float:
    labels = {"grpc_service": SERVICE, "grpc_method": method, "grpc_code": code}
    return REGISTRY.get_sample_value("cachet_grpc_server_handled_total", labels) or 0.0


async def test_calls_are_counted_by_the_status_they_ended_with() -> None:
    before = {
        (method, code): handled(method, code)
        for method, code in [
            ("Unary", "OK"),
            ("Unary", "INVALID_ARGUMENT"),
            ("Unary", "INTERNAL"),
            ("Stream", "OK"),
            ("Stream", "RESOURCE_EXHAUSTED"),
        ]
    }
    running = await create_server(ServiceSettings(port=0), [_register], [SERVICE], metrics_port=0)
    try:
        async with create_channel(running.address) as channel:
            unary = channel.unary_unary(f"/{SERVICE}/Unary")
            stream = channel.unary_stream(f"/{SERVICE}/Stream")
            await unary(b"ok")
            for request in (b"bad", b"bug"):
                with pytest.raises(grpc.aio.AioRpcError):
                    await unary(request)
            assert [m async for m in stream(b"")] == [b"one", b"two"]
            with pytest.raises(grpc.aio.AioRpcError):
                [m async for m in stream(b"busy")]
        figures = scrape(running.metrics_port, "cachet_grpc_")
    finally:
        await running.stop(grace=None)
    grew = {key: handled(*key) - value for key, value in before.items()}
    assert grew == {key: 1.0 for key in before}
    started = ("cachet_grpc_server_started_total", (("grpc_method", "Unary"), ("grpc_service", SERVICE)))
    assert figures[started] >= 3
    assert naming_problems(generate_latest(REGISTRY).decode()) == []


async def test_the_endpoint_stops_with_the_server() -> None:
    running = await create_server(ServiceSettings(port=0), [_register], [SERVICE], metrics_port=0)
    port = running.metrics_port
    await running.stop(grace=None)
    with socket.socket() as probe:
        probe.bind((LOOPBACK, port))  # free again


async def test_a_taken_port_leaves_the_server_serving_without_metrics() -> None:
    """A default port held by a neighbour, or a chosen one taken meanwhile: no /metrics, never a
    failed start (a supervisor would restart the service into the same taken port)."""
    with socket.socket() as holder:
        holder.bind((LOOPBACK, 0))
        holder.listen()
        taken = holder.getsockname()[1]

        class Defaulted(UsageSettings):
            metrics_port: int = taken

        for settings in (Defaulted(port=0), UsageSettings(port=0, metrics_port=taken)):
            running = await create_server(settings, [_register], [SERVICE], metrics_port=taken)
            try:
                assert running.metrics is None
                async with create_channel(running.address) as channel:
                    assert await channel.unary_unary(f"/{SERVICE}/Unary")(b"up") == b"up"
            finally:
                await running.stop(grace=None)
