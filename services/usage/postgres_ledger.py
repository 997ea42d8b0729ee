"""The usage ledger on PostgreSQL, for usage processes that share one database.

The contract is ``cachet.usage.ledger``'s; the table is the SQLite ledger's, with
the same ``ON CONFLICT (request_id) DO NOTHING``. Across processes that is what
makes a record idempotent: of two inserts of one request id, the second waits for
the first to commit and then inserts nothing, and reads the cost stored by the
first. Triggers refuse UPDATE, DELETE and TRUNCATE, so even a hand-typed statement
cannot rewrite what was billed.
"""

from __future__ import annotations

from collections.abc import Sequence

import asyncpg

from cachet.durable_postgres import describe, open_pool, pooled_connection
from cachet.logs import get_logger
from cachet.usage.ledger_query import query_sql, totals
from cachet.usage.prices import ModelPrice
from cachet.usage.records import (
    LEDGER_COST_COLUMN,
    RecordOutcome,
    UsageEntry,
    UsageQuery,
    UsageTotals,
    ledger_row,
)

log = get_logger(__name__)

STORE = "ledger"

MIGRATIONS = [
    (
        1,
        """
CREATE TABLE usage_records (
    request_id TEXT PRIMARY KEY,
    account_id TEXT NOT NULL,
    model TEXT NOT NULL,
    session_id TEXT NOT NULL,
    prompt_tokens BIGINT NOT NULL,
    cached_tokens BIGINT NOT NULL,
    completion_tokens BIGINT NOT NULL,
    finished_at_ms BIGINT NOT NULL,
    replica_address TEXT NOT NULL,
    priority TEXT NOT NULL,
    -- The prices applied, kept so every stored cost can be re-derived and audited.
    input_microusd_per_mtok BIGINT NOT NULL,
    cached_input_microusd_per_mtok BIGINT NOT NULL,
    output_microusd_per_mtok BIGINT NOT NULL,
    cost_picousd BIGINT NOT NULL,
    cache_savings_picousd BIGINT NOT NULL,
    recorded_at_ms BIGINT NOT NULL
);
CREATE INDEX usage_records_account_time ON usage_records (account_id, finished_at_ms);
CREATE INDEX usage_records_time ON usage_records (finished_at_ms);
CREATE FUNCTION usage_records_append_only() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'usage_records is append-only';
END $$;
CREATE TRIGGER usage_records_no_update_or_delete BEFORE UPDATE OR DELETE ON usage_records
    FOR EACH ROW EXECUTE FUNCTION usage_records_append_only();
CREATE TRIGGER usage_records_no_truncate BEFORE TRUNCATE ON usage_records
    FOR EACH STATEMENT EXECUTE FUNCTION usage_records_append_only();
""",
    ),
    (
        2,
        """
-- The managed API key the request came with; '' for others. A key's monthly budget asks
-- for its spend since the month began.
ALTER TABLE usage_records ADD COLUMN api_key_id TEXT NOT NULL DEFAULT '';
CREATE INDEX usage_records_key_time ON usage_records (api_key_id, finished_at_ms);
""",
    ),
]

_INSERT = """
INSERT INTO usage_records (
    request_id, account_id, model, session_id, prompt_tokens, cached_tokens, completion_tokens,
    finished_at_ms, replica_address, priority, input_microusd_per_mtok, cached_input_microusd_per_mtok,
    output_microusd_per_mtok, cost_picousd, cache_savings_picousd, recorded_at_ms, api_key_id
) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15, $16, $17)
ON CONFLICT (request_id) DO NOTHING
RETURNING cost_picousd
"""

# A bigint's whole seconds as a UTC day.
_DAY = "to_char(to_timestamp(finished_at_ms / 1000) AT TIME ZONE 'UTC', 'YYYY-MM-DD')"


class PostgresLedger:
    """The usage ledger in a PostgreSQL database; see ``cachet.usage.ledger`` for the contract."""

    def __init__(self, pool: asyncpg.Pool, location: str) -> None:
        # Use ``open``: it applies the migrations before the first write.
        self._pool = pool
        self.location = location

    @classmethod
    async def open(cls, url: str) -> PostgresLedger:
        pool = await open_pool(url, MIGRATIONS, store=STORE)
        log.info("usage ledger opened", store="postgresql", database=describe(url))
        return cls(pool, describe(url))

    async def record(self, entry: UsageEntry, price: ModelPrice) -> RecordOutcome:
        """Append ``entry`` priced at ``price``, unless its request id is already there."""
        async with pooled_connection(self._pool, STORE) as connection:
            return await self._record(connection, entry, price)

    async def record_many(self, priced: Sequence[tuple[UsageEntry, ModelPrice]]) -> list[RecordOutcome]:
        """``record`` for each entry, in one transaction: one commit for the lot, all or nothing."""
        async with pooled_connection(self._pool, STORE) as connection, connection.transaction():
            return [await self._record(connection, entry, price) for entry, price in priced]

    async def query(self, query: UsageQuery) -> list[UsageTotals]:
        """Totals per group, ordered by the group keys."""
        sql, params = query_sql(query, day_expression=_DAY, placeholder=lambda n: f"${n}")
        async with pooled_connection(self._pool, STORE) as connection:
            rows = await connection.fetch(sql, *params)
        return [totals(query.group_by, tuple(row)) for row in rows]

    async def close(self) -> None:
        await self._pool.close()

    async def _record(
        self, connection: asyncpg.Connection, entry: UsageEntry, price: ModelPrice
    ) -> RecordOutcome:
        row = ledger_row(entry, price)
        inserted = await connection.fetchval(_INSERT, *row)
        if inserted is not None:
            return RecordOutcome(duplicate=False, cost_picousd=row[LEDGER_COST_COLUMN])
        # Read committed: this statement sees the row whose insert ours waited for.
        stored = await connection.fetchrow(
            "SELECT cost_picousd, account_id, model, prompt_tokens, cached_tokens, completion_tokens"
            " FROM usage_records WHERE request_id = $1",
            entry.request_id,
        )
        assert stored is not None, "the insert conflicted with this row, so it is there"
        seen = (
            entry.account_id,
            entry.model,
            entry.prompt_tokens,
            entry.cached_tokens,
            entry.completion_tokens,
        )
        if tuple(stored)[1:] != seen:
            # Same id, different usage: a caller bug (ids reused), not a retry. The
            # first record stands; say so loudly instead of billing twice.
            log.warning("request id reused with different usage; kept the first", request_id=entry.request_id)
        return RecordOutcome(duplicate=True, cost_picousd=stored["cost_picousd"])
