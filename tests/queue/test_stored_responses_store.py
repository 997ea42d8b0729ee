"""The Responses API's stored responses in the queue store, on SQLite and on PostgreSQL: kept per
account with their input items, replaced by id, deleted with them, paged either way, purged with
them past the router's retention."""

from __future__ import annotations

import asyncio

import asyncpg
import pytest
from queue_backends import QueueBackend
from settable_clock import Clock

from cachet.durable_postgres import migrate
from cachet.errors import InvalidArgument, NotFound
from cachet.router import response_retention
from cachet.router.caller import Caller
from cachet.router.postgres_queue_store import MIGRATIONS, STORE, PostgresQueueStore
from cachet.router.queue_store import QueueStore, ResponseItem, StoredResponse
from cachet.router.response_retention import ResponseRetention
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


DAY = 86_400
NOW = 1_700_000_000  # the store's clock, in seconds, for the retention tests


def created(response_id: str, seconds_ago: int, *ids: str) -> StoredResponse:
    return StoredResponse(response_id, NOW - seconds_ago, "s1", b'{"output":[]}', items(*ids))


async def test_responses_past_the_retention_are_purged_with_their_items(
    store: QueueStore, clock: Clock
) -> None:
    clock.now_ms = NOW * 1000
    await store.put_response("acct-a", created("resp_old", 30 * DAY + 1, "msg_1", "msg_2"))
    await store.put_response("acct-b", created("resp_old", 31 * DAY, "msg_1"))
    kept = created("resp_new", 30 * DAY, "msg_3")  # exactly the retention: not past it
    await store.put_response("acct-a", kept)
    assert await store.purge_responses(30 * DAY, limit=100) == 2
    for account in ("acct-a", "acct-b"):
        assert await store.response(account, "resp_old") is None
        # No item rows are left behind either.
        page = await store.response_items(account, "resp_old", newest_first=False, after="", limit=5)
        assert page == ([], False)
    assert await store.response("acct-a", "resp_new", with_items=True) == kept
    assert await store.purge_responses(30 * DAY, limit=100) == 0
    # Time passes: the kept one expires in its turn.
    clock.now_ms += 1000
    assert await store.purge_responses(30 * DAY, limit=100) == 1
    assert await store.response("acct-a", "resp_new") is None


async def test_a_purge_takes_the_oldest_first_up_to_its_limit(store: QueueStore, clock: Clock) -> None:
    clock.now_ms = NOW * 1000
    for age in range(5):
        await store.put_response("acct-a", created(f"resp_{age}", 40 * DAY + age, "msg_1"))
    assert await store.purge_responses(30 * DAY, limit=2) == 2
    left = [await store.response("acct-a", f"resp_{age}") is not None for age in range(5)]
    assert left == [True, True, True, False, False]
    assert await store.purge_responses(30 * DAY, limit=2) == 2
    assert await store.purge_responses(30 * DAY, limit=2) == 1


async def test_the_routers_retention_purges_in_batches_at_start_and_then_on_its_interval(
    store: QueueStore, clock: Clock, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(response_retention, "PURGE_BATCH", 2)
    clock.now_ms = NOW * 1000
    for n in range(5):
        await store.put_response("acct-a", created(f"resp_{n}", 31 * DAY, "msg_1"))
    await store.put_response("acct-a", created("resp_young", DAY))
    retention = ResponseRetention(store, retention_days=30, interval_seconds=0.05)
    retention.start()
    try:
        await wait_for(lambda: store.response("acct-a", "resp_4"), gone=True)
        assert all([await store.response("acct-a", f"resp_{n}") is None for n in range(5)])
        # The next purge, an interval later, finds what has expired since.
        clock.now_ms += 30 * DAY * 1000
        await wait_for(lambda: store.response("acct-a", "resp_young"), gone=True)
    finally:
        await retention.stop()


async def wait_for(read, *, gone: bool, timeout: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while (await read() is None) != gone:
        assert asyncio.get_running_loop().time() < deadline, "the purge never came"
        await asyncio.sleep(0.02)
