"""OpenAI's Responses API: ``POST /v1/responses`` (whole or streamed), ``GET``/``DELETE
/v1/responses/{id}`` and ``GET /v1/responses/{id}/input_items``.

A response is the router's chat completion (the request ``/v1/chat/completions``
sends, ``responses_convert``), answered as output items and typed stream events
(``responses_stream``), billed by the same ledger under its ``resp_`` id. With
``store`` (the default) it is kept per account (``responses_store``): a follow-up
naming it as ``previous_response_id`` resends the stored conversation under the
stored session id, so it lands on the replica that holds that prefix's KV.
"""

from __future__ import annotations

import asyncio
import time
from typing import Annotated, Literal

from fastapi import APIRouter, Path, Query, Request
from fastapi.responses import JSONResponse, Response

from cachet.bridge import responses_convert
from cachet.bridge.app import BackendsDep, CallerDep, _stream, _unary
from cachet.bridge.auth import Caller
from cachet.bridge.calls import SSEDialect, named_sse_event
from cachet.bridge.errors import ERROR_RESPONSES, BridgeError
from cachet.bridge.responses_schemas import (
    DeletedResponse,
    InputItemList,
    ResponseObject,
    ResponsesBody,
)
from cachet.bridge.responses_store import ResponseStore, StoredResponse
from cachet.bridge.responses_stream import ResponseStream
from cachet.logs import get_logger

log = get_logger(__name__)

api = APIRouter(responses=ERROR_RESPONSES)

_SSE = {
    200: {
        "content": {"text/event-stream": {"schema": {"$ref": "#/components/schemas/ResponseStreamEventOut"}}}
    }
}
ResponseId = Annotated[str, Path(min_length=1, max_length=256)]


@api.post("/v1/responses", response_model=ResponseObject, responses=_SSE)
async def create_response(
    body: ResponsesBody, request: Request, caller: CallerDep, backends: BackendsDep
) -> Response:
    """OpenAI Responses; ``stream: true`` answers its typed Server-Sent Events."""
    if body.model_extra:
        # Ignored, not refused: SDKs send fields newer than this API, most of which change nothing.
        log.info("unknown fields ignored", path=request.url.path, fields=sorted(body.model_extra))
    store: ResponseStore = request.app.state.responses
    previous = await _previous(store, caller, body.previous_response_id)
    history = previous.conversation() if previous else []
    items = responses_convert.input_items(body)
    response_id = responses_convert.new_id("resp")
    session = _session(caller, body, previous, response_id)
    message = responses_convert.responses_request_to_proto(body, [*history, *items], response_id, session)
    start = responses_convert.skeleton(body, response_id, int(time.time()))

    def keep(response: responses_convert.Json) -> None:
        if body.store:
            store.put(caller.account_id, StoredResponse(response_id, session, response, [*history, *items]))

    if body.stream:
        # Stored inside the stream, on the event loop: one small row, written before
        # response.completed goes out so that a GET right after it finds the response.
        stream = ResponseStream(start, keep)
        dialect = SSEDialect(named_sse_event, lambda error: named_sse_event(stream.error_event(error)), b"")
        return await _stream(
            request, backends.inference.StreamChatCompletion, message, caller, stream, dialect
        )
    completion = await _unary(request, backends.inference.CreateChatCompletion, message, caller)
    request.app.state.metrics.observe_usage(completion.usage)
    response = responses_convert.response_to_json(start, completion)
    await asyncio.to_thread(keep, response)
    return JSONResponse(response)


@api.get("/v1/responses/{response_id}", response_model=ResponseObject)
async def get_response(response_id: ResponseId, request: Request, caller: CallerDep) -> Response:
    """A stored response, as it was answered."""
    return JSONResponse((await _stored(request, caller, response_id)).response)


@api.delete("/v1/responses/{response_id}", response_model=DeletedResponse)
async def delete_response(response_id: ResponseId, request: Request, caller: CallerDep) -> Response:
    """Forget a stored response; follow-ups can no longer name it."""
    store: ResponseStore = request.app.state.responses
    if not await asyncio.to_thread(store.delete, caller.account_id, response_id):
        raise _not_found(response_id)
    return JSONResponse(responses_convert.deleted_to_json(response_id))


@api.get("/v1/responses/{response_id}/input_items", response_model=InputItemList)
async def list_input_items(
    response_id: ResponseId,
    request: Request,
    caller: CallerDep,
    limit: Annotated[int, Query(ge=1, le=100, description="Items per page.")] = 20,
    order: Annotated[
        Literal["asc", "desc"], Query(description="Oldest (asc) or newest (desc) first.")
    ] = "desc",
    after: Annotated[str | None, Query(description="The page after this item id.")] = None,
) -> Response:
    """The conversation a stored response answered: every earlier turn of its chain, then its input."""
    stored = await _stored(request, caller, response_id)
    return JSONResponse(responses_convert.input_items_to_json(stored.input_items, limit, order, after))


async def _previous(store: ResponseStore, caller: Caller, response_id: str | None) -> StoredResponse | None:
    if response_id is None:
        return None
    stored = await asyncio.to_thread(store.get, caller.account_id, response_id)
    if stored is None:
        raise BridgeError(
            400,
            f"Previous response with id {response_id!r} not found.",
            param="previous_response_id",
            code="previous_response_not_found",
        )
    return stored


async def _stored(request: Request, caller: Caller, response_id: str) -> StoredResponse:
    store: ResponseStore = request.app.state.responses
    stored = await asyncio.to_thread(store.get, caller.account_id, response_id)
    if stored is None:
        raise _not_found(response_id)
    return stored


def _not_found(response_id: str) -> BridgeError:
    return BridgeError(
        404, f"Response with id {response_id!r} not found.", "not_found_error", param="response_id"
    )


def _session(caller: Caller, body: ResponsesBody, previous: StoredResponse | None, response_id: str) -> str:
    """The session that places this response: the caller's own (x-session-affinity, which the
    router takes over any other, or prompt_cache_key), else the chain's, so a follow-up lands
    where its prefix is cached; a new stored conversation starts a session of its own."""
    if caller.session_id or body.prompt_cache_key:
        return caller.session_id or body.prompt_cache_key or ""
    if previous is not None:
        return previous.session_id
    return response_id if body.store else ""
