"""ASGI middleware: a server span and metrics per request, the request body limit, and a
managed key's x-ratelimit-* headers on every answer the router admitted.

Plain ASGI rather than Starlette's BaseHTTPMiddleware, so streamed answers pass
through untouched and the span covers the whole stream, not just its start.
"""

from __future__ import annotations

import time
from typing import Any

from opentelemetry import propagate, trace
from opentelemetry.trace import SpanKind, Status, StatusCode
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from cachet.bridge.errors import (
    BridgeError,
    PayloadTooLarge,
    error_response,
    internal_message,
    rate_limit_headers,
)
from cachet.bridge.metrics import BridgeMetrics
from cachet.common.v1 import common_pb2
from cachet.errors import RATE_LIMITS_METADATA_KEY
from cachet.logs import get_logger

log = get_logger(__name__)
_tracer = trace.get_tracer("cachet.bridge")


def current_trace_id() -> str:
    context = trace.get_current_span().get_span_context()
    return format(context.trace_id, "032x") if context.is_valid else "none"


class TelemetryMiddleware:
    """One SERVER span per request (W3C ``traceparent`` honoured), request metrics, and the last-resort 500.

    The 500 is rendered here, inside the span, so its log line and its message
    carry the same trace id; Starlette's own handler runs outside every middleware.
    """

    def __init__(self, app: ASGIApp, metrics: BridgeMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope.get("headers", [])}
        started = time.perf_counter()
        state = {"status": 500, "started": False}

        async def send_observed(message: Message) -> None:
            if message["type"] == "http.response.start":
                state["status"] = message["status"]
                state["started"] = True
            await send(message)

        with _tracer.start_as_current_span(
            f"{scope['method']} {scope['path']}",
            context=propagate.extract(headers),
            kind=SpanKind.SERVER,
            attributes={"http.request.method": scope["method"], "url.path": scope["path"]},
            record_exception=False,
            set_status_on_exception=False,
        ) as span:
            try:
                await self.app(scope, receive, send_observed)
            except Exception as error:  # noqa: BLE001 - the one place a bug becomes a clean 500
                log.exception("unhandled error", path=scope["path"])
                span.record_exception(error)
                span.set_status(Status(StatusCode.ERROR, type(error).__name__))
                if not state["started"]:
                    failure = BridgeError(500, internal_message(current_trace_id()), "server_error")
                    await error_response(failure, scope["path"])(scope, receive, send_observed)
            route = _route_template(scope)
            span.update_name(f"{scope['method']} {route}")
            span.set_attribute("http.route", route)
            span.set_attribute("http.response.status_code", int(state["status"]))
            if int(state["status"]) >= 500:
                span.set_status(Status(StatusCode.ERROR))
        self.metrics.requests.labels(scope["method"], route, str(state["status"])).inc()
        self.metrics.duration.labels(route).observe(time.perf_counter() - started)


def _route_template(scope: Scope) -> str:
    # The template ("/ai/run/{model}"), not the path: one label per route, not per model or account.
    route = scope.get("route")
    return getattr(route, "path", None) or "unmatched"


class BodyLimitMiddleware:
    """413 for bodies over ``max_bytes``: at once from Content-Length, else while they stream in."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers", [])).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await error_response(PayloadTooLarge(self.max_bytes).error, scope["path"])(scope, receive, send)
            return
        received = 0

        async def receive_limited() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise PayloadTooLarge(self.max_bytes)
            return message

        await self.app(scope, receive_limited, send)


# Where a handler leaves the x-ratelimit-* headers of its router call (the request's state, which
# the endpoint's Request and this middleware's scope share).
_RATE_LIMIT_HEADERS = "rate_limit_headers"


async def keep_rate_limits(request: Any, call: Any) -> None:
    """Keep the key's limits that the router sent with an admitted call, for the answer's headers."""
    for key, value in await call.initial_metadata() or ():
        if key == RATE_LIMITS_METADATA_KEY and isinstance(value, bytes):
            headers = rate_limit_headers(common_pb2.RateLimits.FromString(value))
            setattr(request.state, _RATE_LIMIT_HEADERS, headers)


class RateLimitHeadersMiddleware:
    """Adds OpenAI's x-ratelimit-* headers to an answer whose router call carried a key's limits,
    whatever route built it (JSON or a stream); a refusal's own headers are left as they are."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        state = scope.setdefault("state", {})

        async def send_with_headers(message: Message) -> None:
            headers = state.get(_RATE_LIMIT_HEADERS)
            if message["type"] == "http.response.start" and headers:
                present = {name.lower() for name, _ in message.get("headers", [])}
                extra = [
                    (name.encode("latin-1"), value.encode("latin-1"))
                    for name, value in headers.items()
                    if name.encode("latin-1") not in present
                ]
                message = {**message, "headers": [*message.get("headers", []), *extra]}
            await send(message)

        await self.app(scope, receive, send_with_headers)
