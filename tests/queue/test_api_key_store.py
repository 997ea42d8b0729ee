"""Managed API keys in the queue store, on SQLite and on PostgreSQL: stored hashed, listed, revoked."""

from __future__ import annotations

from pathlib import Path

import asyncpg
import pytest
from queue_backends import QueueBackend
from settable_clock import Clock

from cachet.durable_postgres import migrate
from cachet.router.api_keys import KEY_PREFIX, KeyLimits, key_id_of, new_api_key
from cachet.router.postgres_queue_store import MIGRATIONS, STORE, PostgresQueueStore
from cachet.router.queue_store import QueueStore


async def test_a_key_is_stored_by_hash_and_found_by_its_id(store: QueueStore, clock: Clock) -> None:
    limits = KeyLimits(requests_per_minute=60, tokens_per_minute=10_000, monthly_budget_picousd=5 * 10**12)
    key, record = new_api_key(
        "acct-a", "ci", clock.now_ms, expires_at_ms=clock.now_ms + 60_000, limits=limits
    )
    await store.create_api_key(record)
    found = await store.api_key(key_id_of(key) or "")
    assert found == record
    assert found.matches(key) and not found.matches(key[:-1] + ("A" if key[-1] != "A" else "B"))
    assert found.usable_at(clock.now_ms) and not found.usable_at(clock.now_ms + 60_000)
    assert await store.api_key("key_0000000000000000") is None


async def test_keys_are_listed_per_account_and_revoked_once(store: QueueStore, clock: Clock) -> None:
    _, first = new_api_key("acct-a", "one", clock.now_ms)
    _, other = new_api_key("acct-b", "other", clock.now_ms + 1)
    _, second = new_api_key("acct-a", "two", clock.now_ms + 2)
    for record in (first, other, second):
        await store.create_api_key(record)
    assert [k.name for k in await store.api_keys("acct-a")] == ["one", "two"]
    assert [k.name for k in await store.api_keys()] == ["one", "other", "two"]
    clock.now_ms += 5_000
    revoked = await store.revoke_api_key(first.key_id)
    assert revoked is not None and revoked.revoked_at_ms == clock.now_ms
    assert not revoked.usable_at(clock.now_ms) and revoked.state_at(clock.now_ms) == "revoked"
    clock.now_ms += 5_000
    again = await store.revoke_api_key(first.key_id)
    assert again is not None and again.revoked_at_ms == revoked.revoked_at_ms
    assert await store.revoke_api_key("key_0000000000000000") is None


async def test_last_use_only_moves_forward(store: QueueStore, clock: Clock) -> None:
    _, record = new_api_key("acct-a", "", clock.now_ms)
    await store.create_api_key(record)
    await store.touch_api_key(record.key_id, clock.now_ms + 2_000)
    await store.touch_api_key(record.key_id, clock.now_ms + 1_000)  # a slower router's older use
    found = await store.api_key(record.key_id)
    assert found is not None and found.last_used_at_ms == clock.now_ms + 2_000


async def test_a_batch_remembers_the_key_it_was_queued_with(store: QueueStore) -> None:
    with_key = await store.create_batch("acct-a", "m", [b"one"], api_key_id="key_0123456789abcdef")
    without = await store.create_batch("acct-a", "m", [b"two"])
    assert await store.batch_api_key(with_key) == "key_0123456789abcdef"
    assert await store.batch_api_key(without) == ""


async def test_the_key_itself_is_nowhere_in_the_store(
    store: QueueStore,
    queue_backend: QueueBackend,
    clock: Clock,
    request: pytest.FixtureRequest,
    tmp_path: Path,
) -> None:
    key, record = new_api_key("acct-a", "secret-holder", clock.now_ms)
    await store.create_api_key(record)
    # The random part: after the prefix and the hex id (the random part may hold "-" itself).
    secret = key.removeprefix(KEY_PREFIX).split("-", 1)[1]
    if queue_backend.name == "sqlite":
        stored = b"".join(path.read_bytes() for path in tmp_path.glob("queue.sqlite3*"))
        assert b"secret-holder" in stored  # the name is there, so the scan does see the row
        assert secret.encode() not in stored and key.encode() not in stored
    else:
        connection = await asyncpg.connect(request.getfixturevalue("postgres_url"))
        try:
            rows = await connection.fetch("SELECT row_to_json(k)::text FROM api_keys k")
        finally:
            await connection.close()
        text = "".join(row[0] for row in rows)
        assert "secret-holder" in text and secret not in text


async def test_a_database_of_the_first_schema_gains_the_key_tables(postgres_url: str) -> None:
    connection = await asyncpg.connect(postgres_url)
    try:
        await migrate(connection, MIGRATIONS[:1], store=STORE)
        await connection.execute(
            "INSERT INTO batches (batch_id, account_id, model, webhook_url, jobs, created_at_ms)"
            " VALUES ('batch-old', 'acct-a', 'm', '', 0, 1)"
        )
    finally:
        await connection.close()
    store = await PostgresQueueStore.open(postgres_url)
    try:
        _, record = new_api_key("acct-a", "after upgrade", 1_000)
        await store.create_api_key(record)
        assert await store.api_keys("acct-a") == [record]
        assert await store.batch_api_key("batch-old") == ""
    finally:
        await store.close()
