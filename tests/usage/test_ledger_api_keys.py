"""The ledger sums a managed API key's spend (its monthly budget), on SQLite and PostgreSQL, and
a ledger made before keys existed gains the column without losing a row."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import asyncpg

from cachet.durable_postgres import migrate
from cachet.usage.ledger import Ledger
from cachet.usage.postgres_ledger import MIGRATIONS, STORE, PostgresLedger
from cachet.usage.prices import ModelPrice
from cachet.usage.records import UsageEntry, UsageQuery
from cachet.usage.sqlite_ledger import SqliteLedger

PRICE = ModelPrice()


def entry(request_id: str, api_key_id: str = "", finished_at_ms: int = 2_000_000) -> UsageEntry:
    return UsageEntry(
        request_id=request_id,
        account_id="acct-a",
        model="m1",
        session_id="",
        prompt_tokens=1000,
        cached_tokens=0,
        completion_tokens=100,
        finished_at_ms=finished_at_ms,
        api_key_id=api_key_id,
    )


async def test_spend_is_summed_per_key_from_a_time_on(ledger: Ledger) -> None:
    one = await ledger.record(entry("r1", "key_a"), PRICE)
    await ledger.record(entry("r2", "key_a", finished_at_ms=1_000_000), PRICE)  # before the window
    await ledger.record(entry("r3", "key_b"), PRICE)
    await ledger.record(entry("r4"), PRICE)
    [row] = await ledger.query(UsageQuery(api_key_id="key_a", start_ms=1_500_000))
    assert (row.requests, row.cost_picousd) == (1, one.cost_picousd)
    [everything] = await ledger.query(UsageQuery(account_id="acct-a"))
    assert everything.requests == 4


async def test_a_sqlite_ledger_from_before_keys_is_upgraded_in_place(tmp_path: Path) -> None:
    path = tmp_path / "usage.sqlite3"
    old = await SqliteLedger.open(path)
    await old.record(entry("before"), PRICE)
    await old.close()
    connection = sqlite3.connect(path)
    # The file as the previous build made it: the same table without the key column.
    connection.executescript(
        "DROP INDEX usage_records_key_time; DROP TRIGGER usage_records_no_update;"
        " ALTER TABLE usage_records DROP COLUMN api_key_id;"
    )
    assert "api_key_id" not in {row[1] for row in connection.execute("PRAGMA table_info(usage_records)")}
    connection.close()
    ledger = await SqliteLedger.open(path)
    try:
        await ledger.record(entry("after", "key_a"), PRICE)
        [row] = await ledger.query(UsageQuery(api_key_id="key_a"))
        assert row.requests == 1
        [both] = await ledger.query(UsageQuery())
        assert both.requests == 2
    finally:
        await ledger.close()


async def test_a_postgres_ledger_of_the_first_schema_gains_the_key_column(postgres_url: str) -> None:
    connection = await asyncpg.connect(postgres_url)
    try:
        await migrate(connection, MIGRATIONS[:1], store=STORE)
    finally:
        await connection.close()
    ledger = await PostgresLedger.open(postgres_url)
    try:
        await ledger.record(entry("after", "key_a"), PRICE)
        [row] = await ledger.query(UsageQuery(api_key_id="key_a"))
        assert row.requests == 1
    finally:
        await ledger.close()
