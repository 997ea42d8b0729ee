"""Anthropic's Messages API: ``POST /v1/messages`` (whole or streamed) and ``/v1/messages/count_tokens``.

A message is the router's chat completion (the request ``/v1/chat/completions``
sends, ``anthropic_convert``), answered as Anthropic's content blocks and typed
stream events (``anthropic_stream``), with Anthropic's errors (``errors``, by path)
and usage split its way. It is billed by the same ledger under its ``msg_`` id.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Header, Request
from fastapi.responses import JSONResponse, Response

from cachet.bridge import anthropic_convert
from cachet.bridge.anthropic_schemas import (
    CountTokensBody,
    CountTokensResponse,
    MessageResponse,
    MessagesBody,
    MessagesInput,
)
from cachet.bridge.anthropic_stream import MessageStream
from cachet.bridge.app import BackendsDep, CallerDep, _stream, _unary
from cachet.bridge.calls import ANTHROPIC_SSE
from cachet.bridge.errors import ANTHROPIC_ERROR_RESPONSES
from cachet.logs import get_logger

log = get_logger(__name__)

api = APIRouter(responses=ANTHROPIC_ERROR_RESPONSES)

_SSE: dict[int | str, dict[str, Any]] = {
    200: {
        "content": {"text/event-stream": {"schema": {"$ref": "#/components/schemas/MessageStreamEventOut"}}}
    }
}

# Anthropic's clients send both on every request. Any version is accepted (there is one
# Messages API here), and betas are ignored: none is implemented.
VersionHeader = Annotated[str | None, Header(alias="anthropic-version", description="Accepted, any value.")]
BetaHeader = Annotated[str | None, Header(alias="anthropic-beta", description="Accepted and ignored.")]


@api.post("/v1/messages", response_model=MessageResponse, responses=_SSE)
async def create_message(
    body: MessagesBody,
    request: Request,
    caller: CallerDep,
    backends: BackendsDep,
    _version: VersionHeader = None,
    _beta: BetaHeader = None,
) -> Response:
    """Anthropic Messages; ``stream: true`` answers its typed Server-Sent Events."""
    _log_unknown_fields(body, request)
    message = anthropic_convert.messages_request_to_proto(body)
    if body.stream:
        return await _stream(
            request, backends.inference.StreamChatCompletion, message, caller, MessageStream(), ANTHROPIC_SSE
        )
    completion = await _unary(request, backends.inference.CreateChatCompletion, message, caller)
    request.app.state.metrics.observe_usage(completion.usage)
    return JSONResponse(anthropic_convert.message_to_json(completion))


@api.post("/v1/messages/count_tokens", response_model=CountTokensResponse)
async def count_tokens(
    body: CountTokensBody,
    request: Request,
    caller: CallerDep,
    backends: BackendsDep,
    _version: VersionHeader = None,
    _beta: BetaHeader = None,
) -> Response:
    """The prompt's tokens as a message with it would be billed (template and tools included); free."""
    _log_unknown_fields(body, request)
    template = anthropic_convert.count_tokens_request_to_proto(body)
    rendered = await _unary(request, backends.tokenizer.ApplyChatTemplate, template, caller)
    return JSONResponse(anthropic_convert.count_tokens_to_json(rendered))


def _log_unknown_fields(body: MessagesInput, request: Request) -> None:
    # Ignored, not refused: SDKs send fields newer than this API, most of which change nothing.
    if body.model_extra:
        log.info("unknown fields ignored", path=request.url.path, fields=sorted(body.model_extra))
