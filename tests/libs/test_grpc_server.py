"""The shared server factory: health, reflection, and domain errors as statuses."""

from __future__ import annotations

import sys

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from cachet.config import ServiceSettings
from cachet.errors import InvalidArgument, ResourceExhausted, error_info_from_metadata
from cachet.grpc_channel import create_channel
from cachet.grpc_server import create_server

SERVICE = "cachet.test.v1.Probe"


def _identity(data: bytes) -> bytes:
    return data


async def _unary(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
    if request == b"bad":
        raise InvalidArgument("messages[0].role must be one of system, user", param="messages[0].role")
    if request == b"bug":
        raise KeyError("secret internal detail")
    return request.upper()


async def _stream(request: bytes, context: grpc.aio.ServicerContext):
    yield b"first"
    raise ResourceExhausted("every replica is saturated", retry_after_seconds=3)


def _register(server: grpc.aio.Server) -> None:
    handlers = {
        "Unary": grpc.unary_unary_rpc_method_handler(_unary, _identity, _identity),
        "Stream": grpc.unary_stream_rpc_method_handler(_stream, _identity, _identity),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))


@pytest.fixture
async def server():
    running = await create_server(ServiceSettings(port=0), [_register], [SERVICE])
    yield running
    await running.stop(grace=None)


async def test_domain_errors_become_statuses_with_error_info(server) -> None:
    async with create_channel(server.address) as channel:
        call = channel.unary_unary(f"/{SERVICE}/Unary")
        assert await call(b"ok") == b"OK"
        with pytest.raises(grpc.aio.AioRpcError) as bad:
            await call(b"bad")
        assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "messages[0].role" in bad.value.details()
        info = error_info_from_metadata(bad.value.trailing_metadata())
        assert (info.type, info.param) == ("invalid_request_error", "messages[0].role")


async def test_unexpected_errors_are_internal_without_details(server) -> None:
    async with create_channel(server.address) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as bug:
            await channel.unary_unary(f"/{SERVICE}/Unary")(b"bug")
        assert bug.value.code() == grpc.StatusCode.INTERNAL
        assert "secret" not in bug.value.details()
        assert "trace id" in bug.value.details()


async def test_stream_errors_end_the_stream_with_their_status(server) -> None:
    async with create_channel(server.address) as channel:
        received = []
        with pytest.raises(grpc.aio.AioRpcError) as busy:
            async for message in channel.unary_stream(f"/{SERVICE}/Stream")(b""):
                received.append(message)
        assert received == [b"first"]
        assert busy.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert error_info_from_metadata(busy.value.trailing_metadata()).retry_after_seconds == 3


async def test_health_and_reflection(server) -> None:
    async with create_channel(server.address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        reply = await health.Check(health_pb2.HealthCheckRequest(service=SERVICE))
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        await server.set_serving(False)
        reply = await health.Check(health_pb2.HealthCheckRequest())
        assert reply.status == health_pb2.HealthCheckResponse.NOT_SERVING

        reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
        responses = reflection.ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")])
        )
        names = [s.name async for r in responses for s in r.list_services_response.service]
        assert SERVICE in names and "grpc.health.v1.Health" in names


async def test_a_served_process_hands_the_interpreter_lock_over_quickly(server) -> None:
    # gRPC's polling thread waits for the lock on every completion (see _SWITCH_INTERVAL_SECONDS).
    assert sys.getswitchinterval() == pytest.approx(0.0005)
