"""Every failure the bridge answers, OpenAI-shaped, with the HTTP status that fits.

``{"error": {"message", "type", "param", "code"}}`` whether the request failed
validation here, a service refused it (its gRPC status and ``ErrorInfo`` mapped
by the one table below), or the bridge itself broke (500, generic message, the
trace id to find the log line). Under Anthropic's Messages API (``/v1/messages``)
the same error is rendered Anthropic's way instead: ``{"type": "error", "error":
{"type", "message"}}`` with Anthropic's status and type (``error_response``
picks by path). Nothing else in the bridge builds error JSON.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import grpc
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from cachet.bridge.anthropic_schemas import AnthropicErrorResponse
from cachet.bridge.schemas import ErrorResponse
from cachet.common.v1 import common_pb2
from cachet.errors import error_info_from_metadata

# gRPC status -> (HTTP status, OpenAI error type used when the service gave none).
STATUS_TABLE: dict[grpc.StatusCode, tuple[int, str]] = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.OUT_OF_RANGE: (400, "invalid_request_error"),
    grpc.StatusCode.FAILED_PRECONDITION: (400, "invalid_request_error"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "authentication_error"),
    grpc.StatusCode.PERMISSION_DENIED: (403, "permission_error"),
    grpc.StatusCode.NOT_FOUND: (404, "not_found_error"),
    grpc.StatusCode.ALREADY_EXISTS: (409, "conflict_error"),
    grpc.StatusCode.ABORTED: (409, "conflict_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_exceeded"),
    # The client went away; nobody reads this answer, but logs and metrics do (nginx's 499).
    grpc.StatusCode.CANCELLED: (499, "request_cancelled"),
    grpc.StatusCode.UNIMPLEMENTED: (501, "not_implemented"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (503, "service_unavailable"),
}
# INTERNAL, UNKNOWN, DATA_LOSS and anything unlisted: a server bug, shown without its details.
_SERVER_ERROR = (500, "server_error")
# Statuses a client should retry after a pause; Retry-After is always sent with them.
_RETRYABLE = {429, 503}

_HTTP_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
}


# The error types of a key's own limits (cachet.router.key_limits), as OpenAI names them.
KEY_LIMIT_TYPES = ("requests", "tokens", "insufficient_quota")

# Under this path errors are Anthropic's (its SDKs read nothing else).
ANTHROPIC_PATH = "/v1/messages"

# HTTP status -> (Anthropic's status, Anthropic's error type). Over capacity and unavailable are
# Anthropic's 529 "overloaded" (retried by its clients); what Cachet does not implement is a
# request it cannot serve, 400. Unlisted statuses keep their number, with the type below.
_ANTHROPIC_ERRORS: dict[int, tuple[int, str]] = {
    400: (400, "invalid_request_error"),
    401: (401, "authentication_error"),
    403: (403, "permission_error"),
    404: (404, "not_found_error"),
    413: (413, "request_too_large"),
    429: (529, "overloaded_error"),
    500: (500, "api_error"),
    501: (400, "invalid_request_error"),
    503: (529, "overloaded_error"),
}


@dataclass
class BridgeError(Exception):
    """A failure to answer as ``{"error": ...}`` with ``status``; raised anywhere in a handler."""

    status: int
    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None
    retry_after_seconds: int = 0
    # Sent with the error: OpenAI's x-ratelimit-* when a key's limit refused the call.
    headers: dict[str, str] | None = None

    def __post_init__(self) -> None:
        super().__init__(self.message)

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self._headers())

    def anthropic_status(self) -> int:
        if self._key_limited:
            return 429
        return _ANTHROPIC_ERRORS.get(self.status, (self.status, ""))[0]

    def anthropic_body(self) -> dict[str, Any]:
        default = "invalid_request_error" if self.status < 500 else "api_error"
        kind = _ANTHROPIC_ERRORS.get(self.status, (self.status, default))[1]
        if self._key_limited:
            kind = "rate_limit_error"
        return {"type": "error", "error": {"type": kind, "message": self.message}}

    @property
    def _key_limited(self) -> bool:
        # A key past its own limits is Anthropic's 429 rate_limit_error, not the 529 "overloaded"
        # that says the service is short of capacity (which its clients retry at once).
        return self.status == 429 and self.type in KEY_LIMIT_TYPES

    def anthropic_response(self) -> JSONResponse:
        return JSONResponse(
            self.anthropic_body(), status_code=self.anthropic_status(), headers=self._headers()
        )

    def _headers(self) -> dict[str, str] | None:
        retry = {"Retry-After": str(self.retry_after_seconds)} if self.retry_after_seconds else {}
        return (retry | (self.headers or {})) or None


def is_anthropic_path(path: str) -> bool:
    return path == ANTHROPIC_PATH or path.startswith(ANTHROPIC_PATH + "/")


def error_response(error: BridgeError, path: str) -> JSONResponse:
    """``error`` in the shape of the API that ``path`` belongs to."""
    return error.anthropic_response() if is_anthropic_path(path) else error.response()


class PayloadTooLarge(HTTPException):
    """413 raised while a body streams in.

    An HTTPException because FastAPI's body parsing re-raises those and turns any
    other exception into a generic 400; it carries the full error to render.
    """

    def __init__(self, max_bytes: int) -> None:
        self.error = BridgeError(
            413, f"Request body is larger than the limit of {max_bytes} bytes.", code="request_too_large"
        )
        super().__init__(413, self.error.message)


def from_rpc_error(error: grpc.aio.AioRpcError, trace_id: str) -> BridgeError:
    """The one mapping from a failed gRPC call (status, details, ErrorInfo) to an HTTP error."""
    status, default_type = STATUS_TABLE.get(error.code(), _SERVER_ERROR)
    info = error_info_from_metadata(error.trailing_metadata())
    if status == 500:
        # The service's details may describe its internals; the trace id finds them in its logs.
        return BridgeError(500, internal_message(trace_id), "server_error")
    retry_after = info.retry_after_seconds or (1 if status in _RETRYABLE else 0)
    return BridgeError(
        status=status,
        message=error.details() or error.code().name.lower(),
        type=info.type or default_type,
        param=info.param or None,
        code=info.code or None,
        retry_after_seconds=retry_after,
        headers=rate_limit_headers(info.rate_limits) if info.HasField("rate_limits") else None,
    )


def rate_limit_headers(limits: common_pb2.RateLimits) -> dict[str, str]:
    """OpenAI's x-ratelimit-* headers for the limits a key has (none for a limit it lacks)."""
    headers: dict[str, str] = {}
    for kind, limit, remaining, reset_ms in (
        ("requests", limits.limit_requests, limits.remaining_requests, limits.reset_requests_ms),
        ("tokens", limits.limit_tokens, limits.remaining_tokens, limits.reset_tokens_ms),
    ):
        if limit:
            headers[f"x-ratelimit-limit-{kind}"] = str(limit)
            headers[f"x-ratelimit-remaining-{kind}"] = str(remaining)
            headers[f"x-ratelimit-reset-{kind}"] = openai_duration(reset_ms)
    return headers


def openai_duration(ms: int) -> str:
    """A wait as OpenAI writes its resets: "20ms", "1s", "6m0s", "1h2m3.5s"."""
    if ms < 1000:
        return f"{ms}ms"
    hours, rest = divmod(ms, 3_600_000)
    minutes, rest = divmod(rest, 60_000)
    seconds = f"{rest / 1000:.3f}".rstrip("0").rstrip(".")
    return (f"{hours}h" if hours else "") + (f"{minutes}m" if hours or minutes else "") + f"{seconds}s"


def internal_message(trace_id: str) -> str:
    return f"The server had an error while processing your request (trace id {trace_id})."


def validation_error(error: RequestValidationError) -> BridgeError:
    """Pydantic's first complaint, as OpenAI words it: 400 naming the field (``messages[2].content``)."""
    first = error.errors()[0] if error.errors() else {"loc": (), "msg": "invalid request", "type": ""}
    if first.get("type") == "json_invalid":
        return BridgeError(400, "We could not parse the JSON body of your request.", code="invalid_json")
    missing = first.get("type") == "missing"
    param = field_path(first.get("loc", ()), getattr(error, "body", None), missing)
    if missing:
        return BridgeError(
            400, f"Missing required parameter: '{param}'.", param=param, code="missing_required_parameter"
        )
    message = str(first.get("msg", "invalid request"))
    text = f"Invalid value for '{param}': {message}" if param else message
    return BridgeError(400, text, param=param, code="invalid_value")


def field_path(loc: Sequence[Any], body: Any = None, missing: bool = False) -> str | None:
    """``("body", "messages", 2, "content", "str")`` -> ``messages[2].content``.

    Pydantic puts the name of the union member it tried into ``loc`` ("str",
    "list[...]", "NamedToolChoice", a discriminator value). Walking the request
    body tells real fields (present in the input) from those tags; a field that
    is absent is kept only when it is the missing one the error is about.
    """
    parts = list(loc)
    where = parts.pop(0) if parts and parts[0] in ("body", "query", "path", "header") else "body"
    node = body if where == "body" else None
    path = ""
    for position, part in enumerate(parts):
        last = position == len(parts) - 1
        if isinstance(part, int) and (node is None or (isinstance(node, list) and part < len(node))):
            path += f"[{part}]"
            node = node[part] if node is not None else None
        elif isinstance(part, str) and (node is None or (isinstance(node, dict) and part in node)):
            path += f".{part}" if path else part
            node = node.get(part) if isinstance(node, dict) else None
        elif last and missing and isinstance(part, str):
            path += f".{part}" if path else part
    return path or None


def install_error_handlers(app: FastAPI) -> None:
    """OpenAI-shaped answers for our errors, validation (400, not FastAPI's 422) and routing (404/405/413)."""

    async def on_bridge_error(request: Request, error: Exception) -> JSONResponse:
        assert isinstance(error, BridgeError)
        return error_response(error, request.url.path)

    async def on_validation_error(request: Request, error: Exception) -> JSONResponse:
        assert isinstance(error, RequestValidationError)
        return error_response(validation_error(error), request.url.path)

    async def on_http_error(request: Request, error: Exception) -> JSONResponse:
        assert isinstance(error, HTTPException)
        if isinstance(error, PayloadTooLarge):
            return error_response(error.error, request.url.path)
        message = error.detail if isinstance(error.detail, str) else "request failed"
        bridge_error = BridgeError(
            error.status_code, message, _HTTP_TYPES.get(error.status_code, "api_error")
        )
        response = error_response(bridge_error, request.url.path)
        for name, value in (error.headers or {}).items():
            response.headers[name] = value
        return response

    app.add_exception_handler(BridgeError, on_bridge_error)
    app.add_exception_handler(RequestValidationError, on_validation_error)
    app.add_exception_handler(HTTPException, on_http_error)


# Declared on every route so /openapi.json lists the error shape with its statuses.
ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    status: {"description": description, "model": ErrorResponse}
    for status, description in {
        400: "Invalid request (the field is named in error.param).",
        401: "Missing or unknown API key.",
        403: "The key's account may not use this resource.",
        404: "Unknown model or resource.",
        413: "Request body over the size limit.",
        429: "Over capacity; retry after the Retry-After header's seconds.",
        500: "Server error; the message carries a trace id.",
        501: "Not implemented yet.",
        503: "A backing service is unavailable; retry after Retry-After seconds.",
    }.items()
}

# The same, for Anthropic's Messages API: its error shape and statuses.
ANTHROPIC_ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    status: {"description": description, "model": AnthropicErrorResponse}
    for status, description in {
        400: "Invalid request, or one Cachet does not support (the message names the field).",
        401: "Missing or unknown API key (x-api-key or Authorization: Bearer).",
        403: "The key's account may not use this resource.",
        404: "Unknown model.",
        413: "Request body over the size limit.",
        500: "Server error; the message carries a trace id.",
        529: "Over capacity or a backing service unavailable; retry after Retry-After seconds.",
    }.items()
}
