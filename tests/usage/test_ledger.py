"""The ledger on SQLite and on PostgreSQL: exact stored costs, idempotency under concurrency, SQL groupings."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime

import asyncpg
import pytest
from ledger_backends import LedgerBackend

from cachet.usage.ledger import Ledger
from cachet.usage.prices import ModelPrice
from cachet.usage.records import GroupField, UsageEntry, UsageQuery, UsageTotals

PRICE = ModelPrice()
CHEAP = ModelPrice(input_microusd_per_mtok=1, cached_input_microusd_per_mtok=0, output_microusd_per_mtok=2)


def ms(text: str) -> int:
    return int(datetime.fromisoformat(text).replace(tzinfo=UTC).timestamp() * 1000)


def entry(request_id: str, **fields: object) -> UsageEntry:
    values: dict[str, object] = {
        "account_id": "acct-a",
        "model": "m1",
        "session_id": "",
        "prompt_tokens": 1000,
        "cached_tokens": 600,
        "completion_tokens": 50,
        "finished_at_ms": ms("2026-03-01T12:00:00"),
    }
    values.update(fields)
    return UsageEntry(request_id=request_id, **values)  # type: ignore[arg-type]


async def test_record_stores_the_exact_cost(ledger: Ledger) -> None:
    outcome = await ledger.record(entry("r1"), PRICE)
    assert not outcome.duplicate
    assert outcome.cost_picousd == 400 * 600_000 + 600 * 100_000 + 50 * 3_000_000
    [total] = await ledger.query(UsageQuery())
    assert total == UsageTotals(
        requests=1,
        prompt_tokens=1000,
        cached_tokens=600,
        completion_tokens=50,
        cost_picousd=450_000_000,
        cache_savings_picousd=600 * (600_000 - 100_000),
    )


async def test_a_retry_is_a_no_op_reporting_the_first_cost(ledger: Ledger) -> None:
    first = await ledger.record(entry("r1"), PRICE)
    # Prices changed between the two calls: the stored cost, not a new one, is reported.
    again = await ledger.record(entry("r1"), CHEAP)
    assert again.duplicate and again.cost_picousd == first.cost_picousd
    [total] = await ledger.query(UsageQuery())
    assert (total.requests, total.prompt_tokens, total.cost_picousd) == (1, 1000, first.cost_picousd)


async def test_price_changes_do_not_rewrite_history(ledger: Ledger) -> None:
    await ledger.record(entry("old"), PRICE)
    await ledger.record(entry("new"), CHEAP)
    [total] = await ledger.query(UsageQuery())
    assert total.cost_picousd == PRICE.cost_picousd(1000, 600, 50) + CHEAP.cost_picousd(1000, 600, 50)
    assert total.cache_savings_picousd == 600 * 500_000 + 600 * 1


async def test_concurrent_writes_of_one_id_count_once(ledger: Ledger) -> None:
    outcomes = await asyncio.gather(*(ledger.record(entry("same"), PRICE) for _ in range(50)))
    assert sum(not outcome.duplicate for outcome in outcomes) == 1
    assert {outcome.cost_picousd for outcome in outcomes} == {450_000_000}
    [total] = await ledger.query(UsageQuery())
    assert total.requests == 1


async def test_two_connections_racing_on_the_same_ids_count_each_once(ledger_backend: LedgerBackend) -> None:
    # Two ledgers on one database = two connections, as two processes would have.
    first, second = await ledger_backend.open(), await ledger_backend.open()
    try:
        ids = [f"r{i}" for i in range(40)]
        calls = [ledger.record(entry(i), PRICE) for i in ids for ledger in (first, second)]
        outcomes = await asyncio.gather(*calls)
        assert sum(not outcome.duplicate for outcome in outcomes) == len(ids)
        [total] = await second.query(UsageQuery())
        assert total.requests == len(ids)
        assert total.cost_picousd == len(ids) * 450_000_000
    finally:
        await first.close()
        await second.close()


async def test_records_survive_reopening(ledger_backend: LedgerBackend) -> None:
    ledger = await ledger_backend.open()
    await ledger.record(entry("r1"), PRICE)
    await ledger.close()
    reopened = await ledger_backend.open()
    try:
        assert (await reopened.record(entry("r1"), PRICE)).duplicate
        [total] = await reopened.query(UsageQuery())
        assert total.requests == 1
    finally:
        await reopened.close()


async def test_the_database_refuses_updates_and_deletes(
    ledger: Ledger, ledger_backend: LedgerBackend
) -> None:
    await ledger.record(entry("r1"), PRICE)
    for statement in ("UPDATE usage_records SET cost_picousd = 0", "DELETE FROM usage_records"):
        with pytest.raises(ledger_backend.refusal, match="append-only"):
            await ledger_backend.execute_directly(statement)
    [total] = await ledger.query(UsageQuery())
    assert (total.requests, total.cost_picousd) == (1, 450_000_000)


async def test_record_many_is_all_or_nothing(ledger: Ledger) -> None:
    await ledger.record(entry("before"), PRICE)
    outcomes = await ledger.record_many(
        [(entry("new"), PRICE), (entry("before"), PRICE), (entry("new"), PRICE)]
    )
    assert [outcome.duplicate for outcome in outcomes] == [False, True, True]
    # A value no 64-bit column holds fails the batch (sqlite3 and asyncpg each say so their way).
    with pytest.raises((OverflowError, asyncpg.DataError)):
        await ledger.record_many([(entry("lost"), PRICE), (entry("huge", completion_tokens=2**70), PRICE)])
    [total] = await ledger.query(UsageQuery())
    assert total.requests == 2


@pytest.fixture
async def filled(ledger: Ledger) -> Ledger:
    """Six requests over two accounts, two models, two UTC days (split at midnight), two sessions."""
    rows = [
        entry(
            "a1",
            account_id="acct-a",
            model="m1",
            session_id="s1",
            finished_at_ms=ms("2026-03-01T23:59:59.999"),
        ),
        entry(
            "a2", account_id="acct-a", model="m1", session_id="s1", finished_at_ms=ms("2026-03-02T00:00:00")
        ),
        entry("a3", account_id="acct-a", model="m2", session_id="s2", prompt_tokens=10, cached_tokens=0),
        entry("b1", account_id="acct-b", model="m1", session_id="", cached_tokens=0, completion_tokens=0),
        entry(
            "b2", account_id="acct-b", model="m2", session_id="s9", finished_at_ms=ms("2026-03-02T08:00:00")
        ),
        entry(
            "b3", account_id="acct-b", model="m2", session_id="s9", finished_at_ms=ms("2026-03-02T09:00:00")
        ),
    ]
    for row in rows:
        await ledger.record(row, PRICE)
    return ledger


def keys(rows: list[UsageTotals]) -> list[tuple[str, str, str, str, int]]:
    return [(r.account_id, r.model, r.day, r.session_id, r.requests) for r in rows]


async def test_group_by_account(filled: Ledger) -> None:
    rows = await filled.query(UsageQuery(group_by=(GroupField.ACCOUNT,)))
    assert keys(rows) == [("acct-a", "", "", "", 3), ("acct-b", "", "", "", 3)]
    a = rows[0]
    assert a.prompt_tokens == 2010 and a.cached_tokens == 1200 and a.completion_tokens == 150
    assert a.cost_picousd == 2 * 450_000_000 + PRICE.cost_picousd(10, 0, 50)
    assert a.cache_savings_picousd == 1200 * 500_000


async def test_group_by_model(filled: Ledger) -> None:
    rows = await filled.query(UsageQuery(group_by=(GroupField.MODEL,)))
    assert keys(rows) == [("", "m1", "", "", 3), ("", "m2", "", "", 3)]
    assert rows[0].cost_picousd == 2 * 450_000_000 + PRICE.cost_picousd(1000, 0, 0)


async def test_group_by_utc_day_splits_at_midnight(filled: Ledger) -> None:
    rows = await filled.query(UsageQuery(group_by=(GroupField.DAY,)))
    assert keys(rows) == [("", "", "2026-03-01", "", 3), ("", "", "2026-03-02", "", 3)]


async def test_group_by_session(filled: Ledger) -> None:
    rows = await filled.query(UsageQuery(group_by=(GroupField.SESSION,)))
    assert [(r.session_id, r.requests) for r in rows] == [("", 1), ("s1", 2), ("s2", 1), ("s9", 2)]
    assert rows[3].cache_savings_picousd == 2 * 600 * 500_000


async def test_group_by_combinations_follow_the_callers_order(filled: Ledger) -> None:
    rows = await filled.query(UsageQuery(group_by=(GroupField.DAY, GroupField.ACCOUNT, GroupField.MODEL)))
    assert keys(rows) == [
        ("acct-a", "m1", "2026-03-01", "", 1),
        ("acct-a", "m2", "2026-03-01", "", 1),
        ("acct-b", "m1", "2026-03-01", "", 1),
        ("acct-a", "m1", "2026-03-02", "", 1),
        ("acct-b", "m2", "2026-03-02", "", 2),
    ]


async def test_filters_and_half_open_time_range(filled: Ledger) -> None:
    midnight = ms("2026-03-02T00:00:00")
    [day_two] = await filled.query(UsageQuery(start_ms=midnight))
    assert day_two.requests == 3  # start is inclusive: the request at exactly midnight counts
    [day_one] = await filled.query(UsageQuery(end_ms=midnight))
    assert day_one.requests == 3  # end is exclusive
    [window] = await filled.query(
        UsageQuery(account_id="acct-b", start_ms=midnight, end_ms=ms("2026-03-02T09:00"))
    )
    assert window.requests == 1
    rows = await filled.query(UsageQuery(model="m2", session_id="s9", group_by=(GroupField.ACCOUNT,)))
    assert keys(rows) == [("acct-b", "", "", "", 2)]


async def test_no_match_gives_one_zero_total_or_no_groups(filled: Ledger) -> None:
    assert await filled.query(UsageQuery(account_id="nobody")) == [UsageTotals()]
    assert await filled.query(UsageQuery(account_id="nobody", group_by=(GroupField.MODEL,))) == []
