"""The usage ledger on SQLite (the embedded default): one file, one worker thread.

The contract is ``cachet.usage.ledger``'s. SQLite is blocking, so every call runs on
one ``SqliteWorker`` (as the queue store's do) that owns the one connection; the event
loop only awaits. A call whose caller is cancelled still finishes on the worker: a
committed write is then found as a duplicate by the retry, never half-done.
Triggers in the file itself refuse updates and deletes.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Sequence
from pathlib import Path

from cachet.durable_sqlite import SqliteWorker, open_durable_sqlite
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


SCHEMA_VERSION = 1

_SCHEMA = """
CREATE TABLE IF NOT EXISTS usage_records (
    request_id TEXT PRIMARY KEY,
    account_id TEXT NOT NULL,
    model TEXT NOT NULL,
    session_id TEXT NOT NULL,
    prompt_tokens INTEGER NOT NULL,
    cached_tokens INTEGER NOT NULL,
    completion_tokens INTEGER NOT NULL,
    finished_at_ms INTEGER NOT NULL,
    replica_address TEXT NOT NULL,
    priority TEXT NOT NULL,
    -- The prices applied, kept so every stored cost can be re-derived and audited.
    input_microusd_per_mtok INTEGER NOT NULL,
    cached_input_microusd_per_mtok INTEGER NOT NULL,
    output_microusd_per_mtok INTEGER NOT NULL,
    cost_picousd INTEGER NOT NULL,
    cache_savings_picousd INTEGER NOT NULL,
    recorded_at_ms INTEGER NOT NULL,
    -- The managed API key the request came with; '' for others.
    api_key_id TEXT NOT NULL DEFAULT ''
);
-- Per-account reports over time are the common query; the time index serves the rest.
CREATE INDEX IF NOT EXISTS usage_records_account_time ON usage_records (account_id, finished_at_ms);
CREATE INDEX IF NOT EXISTS usage_records_time ON usage_records (finished_at_ms);
CREATE TRIGGER IF NOT EXISTS usage_records_no_update BEFORE UPDATE ON usage_records
BEGIN SELECT RAISE(ABORT, 'usage_records is append-only'); END;
CREATE TRIGGER IF NOT EXISTS usage_records_no_delete BEFORE DELETE ON usage_records
BEGIN SELECT RAISE(ABORT, 'usage_records is append-only'); END;
"""

_INSERT = """
INSERT INTO usage_records (
    request_id, account_id, model, session_id, prompt_tokens, cached_tokens, completion_tokens,
    finished_at_ms, replica_address, priority, input_microusd_per_mtok, cached_input_microusd_per_mtok,
    output_microusd_per_mtok, cost_picousd, cache_savings_picousd, recorded_at_ms, api_key_id
) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)
ON CONFLICT (request_id) DO NOTHING
"""

# Integer division: whole seconds are enough to name a UTC day.
_DAY = "strftime('%Y-%m-%d', finished_at_ms / 1000, 'unixepoch')"


def _connect(path: Path) -> sqlite3.Connection:
    connection = open_durable_sqlite(path, _SCHEMA, SCHEMA_VERSION, what="ledger", check_same_thread=True)
    _add_api_key_column(connection)
    return connection


def _add_api_key_column(connection: sqlite3.Connection) -> None:
    # A file made before managed API keys lacks the column. Adding it with its default is the
    # whole upgrade, and an older build still writes to an upgraded file (its INSERT names its
    # columns, leaving the key ''), so the schema version stays.
    connection.execute("BEGIN IMMEDIATE")
    try:
        columns = {row[1] for row in connection.execute("PRAGMA table_info(usage_records)")}
        if "api_key_id" not in columns:
            connection.execute("ALTER TABLE usage_records ADD COLUMN api_key_id TEXT NOT NULL DEFAULT ''")
        # A key's monthly budget asks for its spend since the month began.
        connection.execute(
            "CREATE INDEX IF NOT EXISTS usage_records_key_time ON usage_records (api_key_id, finished_at_ms)"
        )
    except BaseException:
        connection.execute("ROLLBACK")
        raise
    connection.execute("COMMIT")


class SqliteLedger:
    """The usage ledger in one SQLite file (WAL); see the module docstring for the contract."""

    def __init__(self, worker: SqliteWorker, path: Path) -> None:
        # Use ``open``: the connection must be made on, and only used from, the worker's thread.
        self._worker = worker
        self.path = path
        self.location = str(path)

    @classmethod
    async def open(cls, path: Path) -> SqliteLedger:
        worker = await SqliteWorker.open(lambda: _connect(path), name="usage-ledger")
        log.info("usage ledger opened", path=str(path))
        return cls(worker, path)

    async def record(self, entry: UsageEntry, price: ModelPrice) -> RecordOutcome:
        """Append ``entry`` priced at ``price``, unless its request id is already there."""
        return await self._worker.run(lambda db: _record(db, entry, price))

    async def record_many(self, priced: Sequence[tuple[UsageEntry, ModelPrice]]) -> list[RecordOutcome]:
        """``record`` for each entry, in one transaction: one fsync for the lot."""
        # All or nothing: a failed batch is retried whole, and the ids make that safe.
        return await self._worker.write(lambda db: [_record(db, entry, price) for entry, price in priced])

    async def query(self, query: UsageQuery) -> list[UsageTotals]:
        """Totals per group, ordered by the group keys."""
        sql, params = query_sql(query, day_expression=_DAY, placeholder=lambda _: "?")
        rows = await self._worker.run(lambda db: db.execute(sql, params).fetchall())
        return [totals(query.group_by, row) for row in rows]

    async def close(self) -> None:
        """Close the connection; a WAL checkpoint folds the log back into the main file."""
        await self._worker.close()


def _record(db: sqlite3.Connection, entry: UsageEntry, price: ModelPrice) -> RecordOutcome:
    row = ledger_row(entry, price)
    cursor = db.execute(_INSERT, row)
    if cursor.rowcount == 1:
        return RecordOutcome(duplicate=False, cost_picousd=row[LEDGER_COST_COLUMN])
    return _stored_outcome(db, entry)


def _stored_outcome(db: sqlite3.Connection, entry: UsageEntry) -> RecordOutcome:
    # Safe outside the INSERT's transaction: a stored row never changes.
    stored = db.execute(
        "SELECT cost_picousd, account_id, model, prompt_tokens, cached_tokens, completion_tokens"
        " FROM usage_records WHERE request_id = ?",
        (entry.request_id,),
    ).fetchone()
    seen = (
        entry.account_id,
        entry.model,
        entry.prompt_tokens,
        entry.cached_tokens,
        entry.completion_tokens,
    )
    if tuple(stored[1:]) != seen:
        # Same id, different usage: a caller bug (ids reused), not a retry. The
        # first record stands; say so loudly instead of billing twice.
        log.warning("request id reused with different usage; kept the first", request_id=entry.request_id)
    return RecordOutcome(duplicate=True, cost_picousd=stored[0])
