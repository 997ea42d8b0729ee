"""The Responses API's stored responses over gRPC: proto in, the queue store, proto out.

They live in the queue's store (SQLite, or the PostgreSQL database routers share), so a
response stored through one router is found through any other and survives restarts.
Every call is scoped to the caller's account: another account's response is NOT_FOUND,
never a different status, so ids cannot be probed. The response and its items are
OpenAI's JSON, which the bridge renders and reads; here they are only kept.
"""

from __future__ import annotations

from cachet.errors import InvalidArgument, NotFound
from cachet.router.caller import Caller
from cachet.router.queue_store import QueueStore, ResponseItem, StoredResponse
from cachet.router.v1 import router_pb2

# The REST route's own bound on ids; an id past it names nothing that could be stored.
MAX_ID_CHARS = 256
_DEFAULT_PAGE, _MAX_PAGE = 20, 100


class StoredResponses:
    def __init__(self, store: QueueStore) -> None:
        self._store = store

    async def put(self, request: router_pb2.StoredResponse, caller: Caller) -> router_pb2.StoredResponseRef:
        _check_id(request.id, "id")
        # Item ids are the client's as much as ours (an input item may carry one): kept as sent.
        items = tuple(ResponseItem(item.id, item.item_json) for item in request.input_items)
        stored = StoredResponse(
            request.id, request.created_at, request.session_id, request.response_json, items
        )
        await self._store.put_response(caller.account_id, stored)
        return router_pb2.StoredResponseRef(id=request.id)

    async def get(
        self, request: router_pb2.GetStoredResponseRequest, caller: Caller
    ) -> router_pb2.StoredResponse:
        _check_id(request.response_id, "response_id")
        stored = await self._store.response(
            caller.account_id, request.response_id, with_items=request.include_input_items
        )
        if stored is None:
            raise _not_found(request.response_id)
        return router_pb2.StoredResponse(
            id=stored.response_id,
            created_at=stored.created_at,
            session_id=stored.session_id,
            response_json=stored.body,
            input_items=[_item(item) for item in stored.input_items],
        )

    async def delete(
        self, request: router_pb2.GetStoredResponseRequest, caller: Caller
    ) -> router_pb2.StoredResponseRef:
        _check_id(request.response_id, "response_id")
        if not await self._store.delete_response(caller.account_id, request.response_id):
            raise _not_found(request.response_id)
        return router_pb2.StoredResponseRef(id=request.response_id)

    async def items(
        self, request: router_pb2.ListStoredResponseItemsRequest, caller: Caller
    ) -> router_pb2.StoredResponseItems:
        _check_id(request.response_id, "response_id")
        if request.limit > _MAX_PAGE:
            raise InvalidArgument(f"limit must be 1 to {_MAX_PAGE}", param="limit")
        if len(request.after) > MAX_ID_CHARS:
            raise InvalidArgument(f"after is longer than {MAX_ID_CHARS} characters", param="after")
        # Asked first so that a missing response reads as such, not as a missing `after`.
        if await self._store.response(caller.account_id, request.response_id) is None:
            raise _not_found(request.response_id)
        page = await self._store.response_items(
            caller.account_id,
            request.response_id,
            newest_first=request.newest_first,
            after=request.after,
            limit=request.limit or _DEFAULT_PAGE,
        )
        if page is None:
            raise NotFound(f"No input item with id {request.after!r} in this response.", param="after")
        found, has_more = page
        return router_pb2.StoredResponseItems(items=[_item(item) for item in found], has_more=has_more)


def _item(item: ResponseItem) -> router_pb2.StoredResponseItem:
    return router_pb2.StoredResponseItem(id=item.item_id, item_json=item.body)


def _check_id(value: str, param: str) -> None:
    if not value:
        raise InvalidArgument(f"{param} is required", param=param)
    if len(value) > MAX_ID_CHARS:
        raise InvalidArgument(f"{param} is longer than {MAX_ID_CHARS} characters", param=param)


def _not_found(response_id: str) -> NotFound:
    return NotFound(f"Response with id {response_id!r} not found.", param="response_id")
