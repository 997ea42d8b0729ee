"""The REST API: OpenAI and Workers AI routes, each one REST body -> one router call -> JSON or SSE.

Anthropic's Messages API (``anthropic_routes``), OpenAI's Responses API
(``responses_routes``) and the OpenAI Files and Batch API (``batch_routes``) are
routers of their own that reuse this module's dependencies.

``create_app(settings)`` builds it; the gRPC channels open in the app's lifespan
(uvicorn runs it; tests enter ``app.router.lifespan_context(app)``).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from functools import partial
from typing import Annotated, Any

import grpc
from fastapi import APIRouter, Depends, FastAPI, Header, Query, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response
from fastapi.security import APIKeyHeader, HTTPAuthorizationCredentials, HTTPBearer
from grpc_health.v1 import health_pb2, health_pb2_grpc

from cachet.bridge import anthropic_schemas, convert, schemas
from cachet.bridge.auth import Authenticator, Caller
from cachet.bridge.calls import (
    OPENAI_SSE,
    Render,
    SSEDialect,
    SSEResponse,
    read_chunk,
    unary_until_disconnect,
)
from cachet.bridge.errors import ERROR_RESPONSES, BridgeError, from_rpc_error, install_error_handlers
from cachet.bridge.metrics import CONTENT_TYPE, BridgeMetrics
from cachet.bridge.middleware import (
    BodyLimitMiddleware,
    RateLimitHeadersMiddleware,
    TelemetryMiddleware,
    current_trace_id,
    keep_rate_limits,
)
from cachet.bridge.responses_schemas import ResponseStreamEventOut
from cachet.bridge.settings import BridgeSettings
from cachet.grpc_channel import create_channel
from cachet.logs import get_logger
from cachet.router.v1 import router_pb2, router_pb2_grpc
from cachet.tls import is_loopback
from cachet.tokenizer.v1 import tokenizer_pb2_grpc
from cachet.usage.v1 import usage_pb2, usage_pb2_grpc

log = get_logger(__name__)

_GROUP_BY = ("account", "model", "day", "session")


@dataclass
class Backends:
    """The gRPC channels and stubs of one app, open between lifespan start and end."""

    settings: BridgeSettings
    channels: list[grpc.aio.Channel] = field(default_factory=list)
    inference: Any = None
    usage: Any = None
    health: Any = None
    # Only Anthropic's count_tokens: the router has no RPC that renders a prompt without running it.
    tokenizer: Any = None

    def open(self) -> None:
        limit, tls = self.settings.max_message_bytes, self.settings.tls
        router = create_channel(self.settings.router_address, limit, tls=tls)
        usage = create_channel(self.settings.usage_address, limit, tls=tls)
        tokenizer = create_channel(self.settings.tokenizer_address, limit, tls=tls)
        self.channels = [router, usage, tokenizer]
        self.inference = router_pb2_grpc.InferenceServiceStub(router)
        self.health = health_pb2_grpc.HealthStub(router)
        self.usage = usage_pb2_grpc.UsageServiceStub(usage)
        self.tokenizer = tokenizer_pb2_grpc.TokenizerServiceStub(tokenizer)

    async def close(self) -> None:
        for channel in self.channels:
            await channel.close()
        self.channels = []


# ---------------------------------------------------------------- dependencies

_bearer = HTTPBearer(auto_error=False, description="API key (any value in open development mode).")
_api_key = APIKeyHeader(
    name="x-api-key", auto_error=False, description="API key, as Anthropic's clients send it."
)


async def _caller(
    request: Request,
    _credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
    x_api_key: Annotated[str | None, Depends(_api_key)],
    x_session_affinity: Annotated[
        str | None, Header(description="Session id: keeps a session on one replica.")
    ] = None,
) -> Caller:
    # The security schemes are declared for /openapi.json; the raw headers are what get checked.
    auth: Authenticator = request.app.state.auth
    return await auth.authenticate(request.headers.get("authorization"), x_session_affinity, x_api_key)


CallerDep = Annotated[Caller, Depends(_caller)]


def _backends(request: Request) -> Backends:
    backends: Backends = request.app.state.backends
    if backends.inference is None:
        raise RuntimeError("bridge backends are not open (the app's lifespan has not started)")
    return backends


BackendsDep = Annotated[Backends, Depends(_backends)]


async def _rpc(awaitable: Awaitable[Any]) -> Any:
    try:
        return await awaitable
    except grpc.aio.AioRpcError as error:
        raise from_rpc_error(error, current_trace_id()) from None


async def _unary(request: Request, method: Any, message: Any, caller: Caller) -> Any:
    call = method(message, metadata=caller.metadata())
    answer = await _rpc(unary_until_disconnect(call, request))
    await keep_rate_limits(request, call)
    return answer


async def _stream(
    request: Request,
    method: Any,
    message: Any,
    caller: Caller,
    render: Render,
    dialect: SSEDialect = OPENAI_SSE,
) -> SSEResponse:
    started = time.perf_counter()
    call = method(message, metadata=caller.metadata())
    try:
        first = await _rpc(read_chunk(call))
        await keep_rate_limits(request, call)
    except BaseException:
        call.cancel()
        raise
    return SSEResponse(call, first, render, request.app.state.metrics, _route(request), started, dialect)


@dataclass(frozen=True)
class _CompletionRoute:
    """What an OpenAI completion route calls on the router and how it renders the answer: chat and
    text completions differ only here."""

    # The router's streaming and whole-answer methods on its stub.
    stream_rpc: Callable[[router_pb2_grpc.InferenceServiceStub], Any]
    unary_rpc: Callable[[router_pb2_grpc.InferenceServiceStub], Any]
    chunk_to_json: Callable[[router_pb2.ChatCompletionChunk, bool], list[convert.Json]]
    completion_to_json: Callable[[router_pb2.ChatCompletion], convert.Json]

    async def answer(
        self,
        request: Request,
        caller: Caller,
        backends: Backends,
        body: schemas.ChatCompletionBody | schemas.CompletionBody,
        message: router_pb2.ChatCompletionRequest | router_pb2.CompletionRequest,
    ) -> Response:
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return await _stream(
                request,
                self.stream_rpc(backends.inference),
                message,
                caller,
                lambda chunk: self.chunk_to_json(chunk, include_usage),
            )
        completion = await _unary(request, self.unary_rpc(backends.inference), message, caller)
        request.app.state.metrics.observe_usage(completion.usage)
        return JSONResponse(self.completion_to_json(completion))


_CHAT_ROUTE = _CompletionRoute(
    lambda stub: stub.StreamChatCompletion,
    lambda stub: stub.CreateChatCompletion,
    convert.chat_chunk_to_json,
    convert.chat_completion_to_json,
)
_TEXT_ROUTE = _CompletionRoute(
    lambda stub: stub.StreamCompletion,
    lambda stub: stub.CreateCompletion,
    convert.text_chunk_to_json,
    convert.text_completion_to_json,
)


def _log_unknown_fields(body: schemas.ChatCompletionBody | schemas.CompletionBody, request: Request) -> None:
    # Another vendor's fields (or a newer OpenAI's) are ignored, but never without a word.
    unknown = sorted(set(body.model_extra or ()) - schemas.QUIET_FIELDS)
    if unknown:
        log.info("unknown fields ignored", path=request.url.path, fields=unknown)


def _route(request: Request) -> str:
    return getattr(request.scope.get("route"), "path", request.url.path)


# ---------------------------------------------------------------- routes

api = APIRouter(responses=ERROR_RESPONSES)

_CHAT_SSE: dict[int | str, dict[str, Any]] = {
    200: {
        "content": {
            "text/event-stream": {"schema": {"$ref": "#/components/schemas/ChatCompletionChunkResponse"}}
        }
    }
}
_TEXT_SSE: dict[int | str, dict[str, Any]] = {
    200: {
        "content": {"text/event-stream": {"schema": {"$ref": "#/components/schemas/TextCompletionResponse"}}}
    }
}
_WORKERS_SSE: dict[int | str, dict[str, Any]] = {
    200: {"content": {"text/event-stream": {"schema": {"$ref": "#/components/schemas/WorkersAIStreamEvent"}}}}
}


@api.post("/v1/chat/completions", response_model=schemas.ChatCompletionResponse, responses=_CHAT_SSE)
async def chat_completions(
    body: schemas.ChatCompletionBody, request: Request, caller: CallerDep, backends: BackendsDep
) -> Response:
    """OpenAI chat completions; ``stream: true`` answers Server-Sent Events (``chat.completion.chunk``)."""
    _log_unknown_fields(body, request)
    message = convert.chat_request_to_proto(body)
    return await _CHAT_ROUTE.answer(request, caller, backends, body, message)


@api.post("/v1/completions", response_model=schemas.TextCompletionResponse, responses=_TEXT_SSE)
async def completions(
    body: schemas.CompletionBody, request: Request, caller: CallerDep, backends: BackendsDep
) -> Response:
    """OpenAI (legacy) text completions; ``stream: true`` answers Server-Sent Events."""
    _log_unknown_fields(body, request)
    message = convert.completion_request_to_proto(body)
    return await _TEXT_ROUTE.answer(request, caller, backends, body, message)


@api.get("/v1/models", response_model=schemas.ModelList)
async def list_models(request: Request, caller: CallerDep, backends: BackendsDep) -> Response:
    """Models the router serves."""
    models = await _unary(request, backends.inference.ListModels, router_pb2.ListModelsRequest(), caller)
    return JSONResponse(convert.models_to_json(models))


@api.post("/ai/run/{model:path}", response_model=schemas.WorkersAIResponse, responses=_WORKERS_SSE)
async def workers_ai_run(
    model: str,
    body: schemas.WorkersAIBody,
    request: Request,
    caller: CallerDep,
    backends: BackendsDep,
    queue_request: Annotated[
        bool, Query(alias="queueRequest", description="Queue (or poll) a batch.")
    ] = False,
) -> Response:
    """Workers AI: run a model (``stream: true`` for SSE), or with ``queueRequest=true`` queue / poll a batch."""
    # A body naming only a request_id is a poll, flag or not (Workers AI semantics).
    if queue_request or body.queue_request or body.request_id is not None:
        return await _queue(model, body, request, caller, backends)
    if body.requests is not None:
        raise BridgeError(400, "requests need queueRequest=true.", param="queueRequest")
    message = convert.workers_ai_request_to_proto(model, body)
    chat = isinstance(message, router_pb2.ChatCompletionRequest)
    if body.stream:
        method = backends.inference.StreamChatCompletion if chat else backends.inference.StreamCompletion
        return await _stream(request, method, message, caller, convert.workers_ai_chunk_to_json)
    method = backends.inference.CreateChatCompletion if chat else backends.inference.CreateCompletion
    completion = await _unary(request, method, message, caller)
    request.app.state.metrics.observe_usage(completion.usage)
    return JSONResponse(convert.workers_ai_result_to_json(completion))


@api.post(
    "/client/v4/accounts/{account_id}/ai/run/{model:path}",
    response_model=schemas.WorkersAIResponse,
    responses=_WORKERS_SSE,
)
async def workers_ai_account_run(
    account_id: str,
    model: str,
    body: schemas.WorkersAIBody,
    request: Request,
    caller: CallerDep,
    backends: BackendsDep,
    queue_request: Annotated[
        bool, Query(alias="queueRequest", description="Queue (or poll) a batch.")
    ] = False,
) -> Response:
    """Workers AI under Cloudflare's account path; the key must belong to ``account_id``."""
    if not request.app.state.auth.dev_mode and account_id != caller.account_id:
        raise BridgeError(
            403, "This API key does not belong to that account.", "permission_error", param="account_id"
        )
    return await workers_ai_run(model, body, request, caller, backends, queue_request)


async def _queue(
    model: str, body: schemas.WorkersAIBody, request: Request, caller: Caller, backends: Backends
) -> Response:
    if body.request_id is not None:
        poll = router_pb2.GetQueuedBatchRequest(request_id=body.request_id)
        batch = await _unary(request, backends.inference.GetQueuedBatch, poll, caller)
        return JSONResponse(convert.queued_batch_to_json(batch))
    if body.requests is None:
        raise BridgeError(
            400, "queueRequest needs requests (to queue) or request_id (to poll).", param="requests"
        )
    message = convert.queue_request_to_proto(model, body)
    batch = await _unary(request, backends.inference.QueueRequests, message, caller)
    return JSONResponse(convert.queued_batch_to_json(batch, model=model))


@api.get("/v1/usage", response_model=schemas.UsageReport)
async def usage(
    request: Request,
    caller: CallerDep,
    backends: BackendsDep,
    group_by: Annotated[
        list[str], Query(description="Any of account, model, day, session; repeated or comma-separated.")
    ] = [],  # noqa: B006 - FastAPI copies query defaults per request
    model: Annotated[str, Query(description="Only this model.")] = "",
    session: Annotated[str, Query(description="Only this session (x-session-affinity).")] = "",
    start: Annotated[
        str | None, Query(description="From (inclusive): Unix seconds or ISO 8601, UTC.")
    ] = None,
    end: Annotated[str | None, Query(description="Until (exclusive): Unix seconds or ISO 8601, UTC.")] = None,
) -> Response:
    """The caller's account's tokens and cost (cached input priced apart), grouped as asked."""
    groups = [g.strip() for value in group_by for g in value.split(",") if g.strip()]
    unknown = [g for g in groups if g not in _GROUP_BY]
    if unknown:
        raise BridgeError(
            400, f"group_by accepts {', '.join(_GROUP_BY)}; got {unknown[0]!r}.", param="group_by"
        )
    query = usage_pb2.QueryUsageRequest(
        account_id=caller.account_id,
        model=model,
        session_id=session,
        start_ms=_time_ms(start, "start"),
        end_ms=_time_ms(end, "end"),
        group_by=groups,
    )
    report = await _unary(request, backends.usage.QueryUsage, query, caller)
    return JSONResponse(convert.usage_report_to_json(report))


def _time_ms(value: str | None, param: str) -> int:
    if not value:
        return 0
    try:
        if value.lstrip("-").replace(".", "", 1).isdigit():
            return int(float(value) * 1000)
        moment = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        raise BridgeError(400, f"{param} must be Unix seconds or an ISO 8601 time.", param=param) from None
    # A time without a zone is UTC, as the usage service's days are.
    moment = moment if moment.tzinfo else moment.replace(tzinfo=UTC)
    return int(moment.timestamp() * 1000)


@api.get("/health", response_model=schemas.HealthResponse)
async def health(request: Request, backends: BackendsDep) -> Response:
    """200 when the router answers its gRPC health check with SERVING, else 503."""
    timeout = request.app.state.settings.health_timeout_seconds
    try:
        reply = await backends.health.Check(health_pb2.HealthCheckRequest(), timeout=timeout)
    except grpc.aio.AioRpcError as error:
        raise BridgeError(
            503, f"router unreachable: {error.code().name}", "service_unavailable", retry_after_seconds=1
        ) from None
    if reply.status != health_pb2.HealthCheckResponse.SERVING:
        raise BridgeError(503, "router is not serving", "service_unavailable", retry_after_seconds=1)
    return JSONResponse({"status": "ok"})


@api.get("/ready", response_model=schemas.HealthResponse)
async def ready(request: Request, backends: BackendsDep) -> Response:
    """200 when a request can be served now: the router is SERVING and some engine replica
    serves a model (what ``/v1/models`` lists); else 503. ``/health`` says only that the bridge
    and the router are up: before the first engine reports, ``/v1/models`` answers an empty
    list and a chat request is refused."""
    await health(request, backends)
    timeout = request.app.state.settings.health_timeout_seconds
    try:
        models = await backends.inference.ListModels(router_pb2.ListModelsRequest(), timeout=timeout)
    except grpc.aio.AioRpcError as error:
        raise BridgeError(
            503, f"router unreachable: {error.code().name}", "service_unavailable", retry_after_seconds=1
        ) from None
    if not models.models:
        raise BridgeError(
            503, "no engine replica serves a model yet", "service_unavailable", retry_after_seconds=1
        )
    return JSONResponse({"status": "ok"})


@api.get("/metrics", response_class=Response, responses={200: {"content": {CONTENT_TYPE: {}}}})
async def metrics(request: Request) -> Response:
    """Prometheus text exposition."""
    return Response(request.app.state.metrics.render(), media_type=CONTENT_TYPE)


# ---------------------------------------------------------------- the app


async def _managed_key_account(backends: Backends, key: str) -> str | None:
    """Whose managed key this is, by the router (which holds the keys); None for nobody's."""
    if backends.inference is None:
        raise RuntimeError("bridge backends are not open (the app's lifespan has not started)")
    try:
        identity = await backends.inference.Authenticate(
            router_pb2.AuthenticateRequest(),
            metadata=(("authorization", f"Bearer {key}"),),
            timeout=backends.settings.health_timeout_seconds,  # a lookup by id, as quick as health
        )
    except grpc.aio.AioRpcError as error:
        if error.code() == grpc.StatusCode.UNAUTHENTICATED:
            return None
        raise from_rpc_error(error, current_trace_id()) from None
    return identity.account_id


def create_app(settings: BridgeSettings) -> FastAPI:
    """The bridge's ASGI app. Refuses open development mode (no API keys) on a non-loopback host."""
    backends = Backends(settings)
    auth = Authenticator(
        dict(settings.api_keys),
        partial(_managed_key_account, backends),
        cache_seconds=settings.key_cache_seconds,
    )
    if auth.dev_mode and not is_loopback(settings.host):
        raise ValueError(
            f"no API keys configured (CACHET_BRIDGE_API_KEYS): open development mode may only bind loopback, "
            f"not {settings.host!r}"
        )
    if auth.dev_mode:
        log.warning(
            "OPEN DEVELOPMENT MODE: no API keys configured, every request is accepted as account 'anonymous'",
            host=settings.host,
        )

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        backends.open()
        try:
            yield
        finally:
            await backends.close()

    app = FastAPI(
        title="Cachet",
        summary="OpenAI-, Anthropic- and Workers-AI-compatible inference, with prefix caching you can see.",
        version="0.1.0",
        lifespan=lifespan,
    )
    app.state.settings = settings
    app.state.auth = auth
    app.state.backends = backends
    app.state.metrics = BridgeMetrics()
    install_error_handlers(app)
    app.include_router(api)
    # Imported here, not at the top: the batch routes reuse this module's dependencies.
    from cachet.bridge.batch_routes import api as batch_api

    app.include_router(batch_api)
    from cachet.bridge.anthropic_routes import api as anthropic_api

    app.include_router(anthropic_api)
    from cachet.bridge.responses_routes import api as responses_api

    app.include_router(responses_api)
    from cachet.bridge.dashboard import api as dashboard_api

    app.include_router(dashboard_api)
    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.max_body_bytes)
    app.add_middleware(RateLimitHeadersMiddleware)
    # Added last, so outermost: its span and its 500 cover everything inside.
    app.add_middleware(TelemetryMiddleware, metrics=app.state.metrics)
    app.openapi = lambda: _openapi(app)  # type: ignore[method-assign]
    return app


def _openapi(app: FastAPI) -> dict[str, Any]:
    """FastAPI's schema, plus the SSE event models that only appear under text/event-stream."""
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version, summary=app.summary, routes=app.routes)
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        for model in (
            schemas.ChatCompletionChunkResponse,
            schemas.TextCompletionResponse,
            schemas.WorkersAIStreamEvent,
            anthropic_schemas.MessageStreamEventOut,
            ResponseStreamEventOut,
        ):
            definition = model.model_json_schema(
                ref_template="#/components/schemas/{model}", mode="serialization"
            )
            components.update(definition.pop("$defs", {}))
            components.setdefault(model.__name__, definition)
        # Validation errors answer 400 with ErrorResponse (errors.py), never FastAPI's 422.
        for operations in schema.get("paths", {}).values():
            for operation in operations.values():
                operation.get("responses", {}).pop("422", None)
        components.pop("HTTPValidationError", None)
        components.pop("ValidationError", None)
        app.openapi_schema = schema
    return app.openapi_schema
