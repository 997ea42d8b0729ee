"""gRPC calls whose lifetime is the HTTP client's: SSE streams and cancellation on disconnect.

When a client goes away, its gRPC call is cancelled, and the router aborts the
engine request: an abandoned generation must not keep a GPU slot busy.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from cachet.bridge.errors import BridgeError, from_rpc_error
from cachet.bridge.metrics import BridgeMetrics
from cachet.bridge.middleware import current_trace_id
from cachet.router.v1 import router_pb2

T = TypeVar("T")
Render = Callable[[router_pb2.ChatCompletionChunk], list[dict[str, Any]]]

DONE = b"data: [DONE]\n\n"


def sse_event(data: dict[str, Any]) -> bytes:
    """One Server-Sent Event framed as OpenAI frames it: ``data: <json>`` and a blank line."""
    return b"data: " + _json(data) + b"\n\n"


def named_sse_event(data: dict[str, Any]) -> bytes:
    """One Server-Sent Event framed as Anthropic frames it: ``event: <its type>``, then the data."""
    return b"event: " + str(data["type"]).encode() + b"\ndata: " + _json(data) + b"\n\n"


def _json(data: dict[str, Any]) -> bytes:
    return json.dumps(data, separators=(",", ":"), ensure_ascii=False).encode()


@dataclass(frozen=True)
class SSEDialect:
    """How an API frames its stream: each event, the failure that ends one midway, and its end."""

    event: Callable[[dict[str, Any]], bytes]
    error: Callable[[BridgeError], bytes]
    # Written after the last event of a stream that ended well.
    end: bytes


OPENAI_SSE = SSEDialect(sse_event, lambda error: sse_event(error.body()), DONE)
# Anthropic's stream ends with its message_stop event, nothing after it.
ANTHROPIC_SSE = SSEDialect(named_sse_event, lambda error: named_sse_event(error.anthropic_body()), b"")


async def unary_until_disconnect(call: Any, request: Request) -> Any:
    """Await a unary call, cancelling it if the client disconnects first.

    Starlette cancels nothing for a non-streaming handler whose client left, so the
    bridge watches ``http.disconnect`` itself (the body has been read by now).
    """
    watcher = asyncio.create_task(_cancel_on_disconnect(call, request.receive))
    try:
        return await call
    finally:
        watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watcher


async def _cancel_on_disconnect(call: Any, receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
    call.cancel()


async def read_chunk(call: Any) -> router_pb2.ChatCompletionChunk | None:
    """Read the first message before answering, so a refused request gets its real HTTP status, not a 200 stream."""
    message = await call.read()
    return None if message is grpc.aio.EOF else message


class SSEResponse(StreamingResponse):
    """``text/event-stream`` of a router stream; the gRPC call is cancelled however the response ends."""

    def __init__(
        self,
        call: Any,
        first: router_pb2.ChatCompletionChunk | None,
        render: Render,
        metrics: BridgeMetrics,
        route: str,
        started: float,
        dialect: SSEDialect = OPENAI_SSE,
    ) -> None:
        self.call = call
        super().__init__(
            self._events(first, render, metrics, route, started, dialect),
            media_type="text/event-stream",
            # Proxies (nginx) must pass events on as they come, not buffer the stream.
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            # A no-op for a finished call; for a client that left, the router aborts the request.
            self.call.cancel()

    async def _events(
        self,
        chunk: router_pb2.ChatCompletionChunk | None,
        render: Render,
        metrics: BridgeMetrics,
        route: str,
        started: float,
        dialect: SSEDialect,
    ) -> AsyncIterator[bytes]:
        first = True
        try:
            while chunk is not None:
                if chunk.HasField("usage"):
                    metrics.observe_usage(chunk.usage)
                for event in render(chunk):
                    if first:
                        metrics.first_event.labels(route).observe(time.perf_counter() - started)
                        first = False
                    yield dialect.event(event)
                chunk = await read_chunk(self.call)
        except grpc.aio.AioRpcError as error:
            # Headers are gone already: the failure becomes the last event, as both APIs do it.
            yield dialect.error(from_rpc_error(error, current_trace_id()))
            return
        if dialect.end:
            yield dialect.end
