"""The Responses API's stored responses in the queue store, on SQLite and on PostgreSQL: kept per
account with their input items, replaced by id, deleted with them, paged either way."""

from __future__ import annotations

import asyncpg
import pytest
from queue_backends import QueueBackend

from cachet.durable_postgres import migrate
from cachet.errors import InvalidArgument, NotFound
from cachet.router.caller import Caller
from cachet.router.postgres_queue_store import MIGRATIONS, STORE, PostgresQueueStore
from cachet.router.queue_store import QueueStore, ResponseItem, StoredResponse
from cachet.router.stored_responses import StoredResponses
from cachet.router.v1 import router_pb2


def items(*ids: str) -> tuple[ResponseItem, ...]:
    return tuple(ResponseItem(item_id, f'{{"id":"{item_id}"}}'.encode()) for item_id in ids)


def response(response_id: str = "resp_1", *ids: str, session: str = "s1") -> StoredResponse:
    return StoredResponse(response_id, 1_700_000_000, session, b'{"output":[]}', items(*ids))


async def test_a_response_is_the_account_s_alone(store: QueueStore) -> None:
    kept = response("resp_1", "msg_1", "msg_2")
    await store.put_response("acct-a", kept)
    assert await store.response("acct-a", "resp_1", with_items=True) == kept
    assert await store.response("acct-a", "resp_1") == StoredResponse(
        "resp_1", 1_700_000_000, "s1", b'{"output":[]}'
    )
    assert await store.response("acct-b", "resp_1") is None
    assert await store.response_items("acct-b", "resp_1", newest_first=False, after="msg_1", limit=5) is None
    assert not await store.delete_response("acct-b", "resp_1")
    assert await store.response("acct-a", "resp_1") is not None
    assert await store.delete_response("acct-a", "resp_1")
    assert await store.response("acct-a", "resp_1", with_items=True) is None
    assert not await store.delete_response("acct-a", "resp_1")
    assert await store.response_items("acct-a", "resp_1", newest_first=False, after="", limit=5) == (
        [],
        False,
    )


async def test_a_put_of_the_same_id_replaces_response_and_items(store: QueueStore) -> None:
    await store.put_response("acct-a", response("resp_1", "msg_1", "msg_2", "msg_3"))
    again = response("resp_1", "msg_9", session="s2")
    await store.put_response("acct-a", again)
    assert await store.response("acct-a", "resp_1", with_items=True) == again
    # The same id in another account is another response.
    await store.put_response("acct-b", response("resp_1"))
    assert await store.response("acct-a", "resp_1", with_items=True) == again


async def test_input_items_page_either_way(store: QueueStore) -> None:
    await store.put_response("acct-a", response("resp_1", *(f"msg_{n}" for n in range(5))))

    async def page(newest_first: bool, after: str, limit: int) -> tuple[list[str], bool] | None:
        found = await store.response_items(
            "acct-a", "resp_1", newest_first=newest_first, after=after, limit=limit
        )
        return None if found is None else ([item.item_id for item in found[0]], found[1])

    assert await page(True, "", 2) == (["msg_4", "msg_3"], True)
    assert await page(True, "msg_3", 2) == (["msg_2", "msg_1"], True)
    assert await page(True, "msg_1", 2) == (["msg_0"], False)
    assert await page(False, "", 5) == ([f"msg_{n}" for n in range(5)], False)
    assert await page(False, "msg_3", 10) == (["msg_4"], False)
    assert await page(False, "msg_4", 10) == ([], False)
    assert await page(False, "msg_x", 10) is None


async def test_a_response_stored_by_one_router_is_read_by_another(queue_backend: QueueBackend) -> None:
    first, second = await queue_backend.open(None), await queue_backend.open(None)
    try:
        kept = response("resp_shared", "msg_1")
        await first.put_response("acct-a", kept)
        assert await second.response("acct-a", "resp_shared", with_items=True) == kept
        assert await second.delete_response("acct-a", "resp_shared")
        assert await first.response("acct-a", "resp_shared") is None
    finally:
        await first.close()
        await second.close()


async def test_a_long_conversation_and_binary_safe_bodies(store: QueueStore) -> None:
    body = "é\x00\U0001f600".encode()
    long = StoredResponse("resp_1", 5, "", body, items(*(f"msg_{n}" for n in range(2_000))))
    await store.put_response("acct-a", long)
    assert await store.response("acct-a", "resp_1", with_items=True) == long


async def test_a_database_of_the_second_schema_gains_the_response_tables(postgres_url: str) -> None:
    connection = await asyncpg.connect(postgres_url)
    try:
        await migrate(connection, MIGRATIONS[:2], store=STORE)
    finally:
        await connection.close()
    store = await PostgresQueueStore.open(postgres_url)
    try:
        await store.put_response("acct-a", response("resp_1", "msg_1"))
        assert await store.response("acct-a", "resp_1", with_items=True) == response("resp_1", "msg_1")
    finally:
        await store.close()


async def test_the_rpcs_are_scoped_to_the_caller_s_account(store: QueueStore) -> None:
    """StoredResponses (the servicer's half): another account's response is NOT_FOUND whatever
    the call, and bad pages are INVALID_ARGUMENT naming the field."""
    rpcs = StoredResponses(store)
    owner, other = Caller("acct-a", ""), Caller("acct-b", "")
    item = router_pb2.StoredResponseItem(id="msg_1", item_json=b'{"id":"msg_1"}')
    sent = router_pb2.StoredResponse(
        id="resp_1", created_at=3, session_id="s", response_json=b"{}", input_items=[item]
    )
    assert (await rpcs.put(sent, owner)).id == "resp_1"
    named = router_pb2.GetStoredResponseRequest(response_id="resp_1", include_input_items=True)
    assert await rpcs.get(named, owner) == sent
    without_items = await rpcs.get(router_pb2.GetStoredResponseRequest(response_id="resp_1"), owner)
    assert not without_items.input_items and without_items.session_id == "s"
    listed = router_pb2.ListStoredResponseItemsRequest(response_id="resp_1")
    assert list((await rpcs.items(listed, owner)).items) == [item]
    for call in (
        rpcs.get(named, other),
        rpcs.delete(named, other),
        rpcs.items(listed, other),
        rpcs.items(router_pb2.ListStoredResponseItemsRequest(response_id="resp_1", after="msg_x"), owner),
    ):
        with pytest.raises(NotFound):
            await call
    for bad in (
        router_pb2.ListStoredResponseItemsRequest(response_id="resp_1", limit=101),
        router_pb2.ListStoredResponseItemsRequest(response_id=""),
        router_pb2.ListStoredResponseItemsRequest(response_id="r" * 257),
    ):
        with pytest.raises(InvalidArgument):
            await rpcs.items(bad, owner)
    with pytest.raises(InvalidArgument):
        await rpcs.put(router_pb2.StoredResponse(), owner)
    assert (await rpcs.delete(named, owner)).id == "resp_1"
    with pytest.raises(NotFound):
        await rpcs.get(named, owner)
