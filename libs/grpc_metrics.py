"""Prometheus figures of every gRPC call a Cachet server answers, by service, method and code.

The names and labels are go-grpc-prometheus's (``grpc_server_started_total``,
``grpc_server_handled_total``, ``grpc_server_handling_seconds``, labels ``grpc_service``,
``grpc_method``, ``grpc_code``) under Cachet's prefix, so dashboards written for gRPC
services read them as they are. One interceptor in ``create_server`` gives every service
them, the tokenizer and usage included, without a line in their servicers.
"""

from __future__ import annotations

import asyncio
import time

import grpc
from prometheus_client import Counter, Histogram

STARTED = Counter(
    "cachet_grpc_server_started",
    "gRPC calls started on this server.",
    ["grpc_service", "grpc_method"],
)
HANDLED = Counter(
    "cachet_grpc_server_handled",
    "gRPC calls completed on this server, by status code.",
    ["grpc_service", "grpc_method", "grpc_code"],
)
HANDLING_SECONDS = Histogram(
    "cachet_grpc_server_handling_seconds",
    "Time from a call's start to its last response (a stream's whole life).",
    ["grpc_service", "grpc_method"],
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300),
)


def _split(full_method: str) -> tuple[str, str]:
    # "/cachet.usage.v1.UsageService/RecordUsage" -> ("cachet.usage.v1.UsageService", "RecordUsage")
    service, _, method = full_method.lstrip("/").rpartition("/")
    return service, method


class _Call:
    """One call's labels and clock; ``done`` records how it ended."""

    def __init__(self, full_method: str) -> None:
        self.labels = _split(full_method)
        self.started = time.perf_counter()
        STARTED.labels(*self.labels).inc()

    def done(self, context: grpc.aio.ServicerContext, raised: BaseException | None) -> None:
        code = context.code()
        if isinstance(raised, (asyncio.CancelledError, GeneratorExit)):
            code = grpc.StatusCode.CANCELLED
        elif raised is not None and code in (None, grpc.StatusCode.OK):
            # Not aborted with a code: grpc answers UNKNOWN for it.
            code = grpc.StatusCode.UNKNOWN
        # context.code() is an int or a StatusCode depending on how it was set.
        name = code.name if isinstance(code, grpc.StatusCode) else _code_name(code)
        HANDLED.labels(*self.labels, name).inc()
        HANDLING_SECONDS.labels(*self.labels).observe(time.perf_counter() - self.started)


def _code_name(code: int | None) -> str:
    if code is None:
        return "OK"
    return next((status.name for status in grpc.StatusCode if status.value[0] == code), "UNKNOWN")


class MetricsInterceptor(grpc.aio.ServerInterceptor):
    """Counts every call (started, handled by code) and times it; the outermost interceptor,
    so it sees the status the domain-error interceptor chose."""

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method
        if handler.unary_unary:
            return grpc.unary_unary_rpc_method_handler(
                _timed_unary(handler.unary_unary, method),
                handler.request_deserializer,
                handler.response_serializer,
            )
        if handler.stream_unary:
            return grpc.stream_unary_rpc_method_handler(
                _timed_unary(handler.stream_unary, method),
                handler.request_deserializer,
                handler.response_serializer,
            )
        if handler.unary_stream:
            return grpc.unary_stream_rpc_method_handler(
                _timed_stream(handler.unary_stream, method),
                handler.request_deserializer,
                handler.response_serializer,
            )
        return grpc.stream_stream_rpc_method_handler(
            _timed_stream(handler.stream_stream, method),
            handler.request_deserializer,
            handler.response_serializer,
        )


def _timed_unary(behavior, method: str):
    async def timed(request, context):
        call = _Call(method)
        try:
            response = await behavior(request, context)
        except BaseException as raised:
            call.done(context, raised)
            raise
        call.done(context, None)
        return response

    return timed


def _timed_stream(behavior, method: str):
    async def timed(request, context):
        call = _Call(method)
        try:
            async for response in behavior(request, context):
                yield response
        except BaseException as raised:
            call.done(context, raised)
            raise
        call.done(context, None)

    return timed
