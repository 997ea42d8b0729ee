"""OpenAI's Responses API: ``POST /v1/responses`` (whole or streamed), ``GET``/``DELETE
/v1/responses/{id}`` and ``GET /v1/responses/{id}/input_items``.

A response is the router's chat completion (the request ``/v1/chat/completions``
sends, ``responses_convert``), answered as output items and typed stream events
(``responses_stream``), billed by the same ledger under its ``resp_`` id. With
``store`` (the default) it is kept per account by the router, in the queue's
durable store (``PutStoredResponse`` and its siblings), so every bridge and router
sharing that store finds it; the bridge keeps nothing. A follow-up naming it as
``previous_response_id`` resends the stored conversation under the stored session
id, so it lands on the replica that holds that prefix's KV.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Path, Query, Request
from fastapi.responses import JSONResponse, Response

from cachet.bridge import responses_convert
from cachet.bridge.app import Backends, BackendsDep, CallerDep, _rpc, _stream, _unary
from cachet.bridge.auth import Caller
from cachet.bridge.calls import SSEDialect, named_sse_event
from cachet.bridge.errors import ERROR_RESPONSES, BridgeError
from cachet.bridge.responses_schemas import (
    DeletedResponse,
    InputItemList,
    ResponseObject,
    ResponsesBody,
)
from cachet.bridge.responses_stream import ResponseStream
from cachet.logs import get_logger
from cachet.router.v1 import router_pb2

log = get_logger(__name__)

api = APIRouter(responses=ERROR_RESPONSES)

_SSE: dict[int | str, dict[str, Any]] = {
    200: {
        "content": {"text/event-stream": {"schema": {"$ref": "#/components/schemas/ResponseStreamEventOut"}}}
    }
}
ResponseId = Annotated[str, Path(min_length=1, max_length=256)]
Keep = Callable[[responses_convert.Json], Awaitable[None]]


@api.post("/v1/responses", response_model=ResponseObject, responses=_SSE)
async def create_response(
    body: ResponsesBody, request: Request, caller: CallerDep, backends: BackendsDep
) -> Response:
    """OpenAI Responses; ``stream: true`` answers its typed Server-Sent Events."""
    if body.model_extra:
        # Ignored, not refused: SDKs send fields newer than this API, most of which change nothing.
        log.info("unknown fields ignored", path=request.url.path, fields=sorted(body.model_extra))
    previous = await _previous(backends, caller, body.previous_response_id)
    history = responses_convert.conversation(previous) if previous else []
    items = responses_convert.input_items(body)
    response_id = responses_convert.new_id("resp")
    session = _session(caller, body, previous, response_id)
    message = responses_convert.responses_request_to_proto(body, [*history, *items], response_id, session)
    start = responses_convert.skeleton(body, response_id, int(time.time()))

    async def keep(response: responses_convert.Json) -> None:
        if body.store:
            stored = responses_convert.stored_to_proto(response, session, [*history, *items])
            await _call(backends.inference.PutStoredResponse, stored, caller)

    if body.stream:
        finished: list[responses_convert.Json] = []
        stream = ResponseStream(start, finished.append)
        dialect = SSEDialect(named_sse_event, lambda error: named_sse_event(stream.error_event(error)), b"")
        answer = await _stream(
            request, backends.inference.StreamChatCompletion, message, caller, stream, dialect
        )
        answer.body_iterator = _stored_first(answer.body_iterator, finished, keep, dialect)
        return answer
    completion = await _unary(request, backends.inference.CreateChatCompletion, message, caller)
    request.app.state.metrics.observe_usage(completion.usage)
    response = responses_convert.response_to_json(start, completion)
    await keep(response)
    return JSONResponse(response)


@api.get("/v1/responses/{response_id}", response_model=ResponseObject)
async def get_response(response_id: ResponseId, caller: CallerDep, backends: BackendsDep) -> Response:
    """A stored response, as it was answered."""
    asked = router_pb2.GetStoredResponseRequest(response_id=response_id)
    stored = await _call(backends.inference.GetStoredResponse, asked, caller)
    return JSONResponse(responses_convert.stored_response(stored))


@api.delete("/v1/responses/{response_id}", response_model=DeletedResponse)
async def delete_response(response_id: ResponseId, caller: CallerDep, backends: BackendsDep) -> Response:
    """Forget a stored response; follow-ups can no longer name it."""
    asked = router_pb2.GetStoredResponseRequest(response_id=response_id)
    await _call(backends.inference.DeleteStoredResponse, asked, caller)
    return JSONResponse(responses_convert.deleted_to_json(response_id))


@api.get("/v1/responses/{response_id}/input_items", response_model=InputItemList)
async def list_input_items(
    response_id: ResponseId,
    caller: CallerDep,
    backends: BackendsDep,
    limit: Annotated[int, Query(ge=1, le=100, description="Items per page.")] = 20,
    order: Annotated[
        Literal["asc", "desc"], Query(description="Oldest (asc) or newest (desc) first.")
    ] = "desc",
    after: Annotated[str | None, Query(max_length=256, description="The page after this item id.")] = None,
) -> Response:
    """The conversation a stored response answered: every earlier turn of its chain, then its input."""
    asked = router_pb2.ListStoredResponseItemsRequest(
        response_id=response_id, limit=limit, newest_first=order == "desc", after=after or ""
    )
    page = await _call(backends.inference.ListStoredResponseItems, asked, caller)
    return JSONResponse(responses_convert.input_items_to_json(page))


async def _previous(
    backends: Backends, caller: Caller, response_id: str | None
) -> router_pb2.StoredResponse | None:
    if response_id is None:
        return None
    asked = router_pb2.GetStoredResponseRequest(response_id=response_id, include_input_items=True)
    try:
        return await _call(backends.inference.GetStoredResponse, asked, caller)
    except BridgeError as error:
        # The router's 404 (or 400 for an id it cannot hold) is, for a follow-up, OpenAI's 400.
        if error.status not in (400, 404):
            raise
    raise BridgeError(
        400,
        f"Previous response with id {response_id!r} not found.",
        param="previous_response_id",
        code="previous_response_not_found",
    )


async def _call(method: Any, message: Any, caller: Caller) -> Any:
    """A stored-response RPC, as the caller (the router scopes it to the caller's account)."""
    return await _rpc(method(message, metadata=caller.metadata()))


async def _stored_first(
    events: AsyncIterable[Any], finished: list[responses_convert.Json], keep: Keep, dialect: SSEDialect
) -> AsyncIterator[Any]:
    """The stream's events, with the finished response stored before the first event of its last
    chunk (so before ``response.completed``): a client that reads that event and asks ``GET``
    finds it. The stream renders synchronously, so the store's await happens here, between events."""
    kept = False
    async for event in events:
        if finished and not kept:
            kept = True
            try:
                await keep(finished[0])
            except BridgeError as error:
                # Answered but not stored: the client must not be told it was, as a follow-up would fail.
                yield dialect.error(error)
                return
        yield event


def _session(
    caller: Caller, body: ResponsesBody, previous: router_pb2.StoredResponse | None, response_id: str
) -> str:
    """The session that places this response: the caller's own (x-session-affinity, which the
    router takes over any other, or prompt_cache_key), else the chain's, so a follow-up lands
    where its prefix is cached; a new stored conversation starts a session of its own."""
    if caller.session_id or body.prompt_cache_key:
        return caller.session_id or body.prompt_cache_key or ""
    if previous is not None:
        return previous.session_id
    return response_id if body.store else ""
