"""The append-only usage ledger, keyed by request id: its contract, and the choice of store.

Contract (``SqliteLedger``, the embedded default, and ``PostgresLedger``, for usage
processes that share one database, both keep it):

- ``record`` stores an entry with its cost and cache savings computed from the
  price in force *now*; later price changes never rewrite history. A second
  record with the same request id changes nothing and reports ``duplicate=True``
  with the cost stored the first time, so a caller's retry sees the same answer,
  whichever process served either call.
- ``record_many`` records a batch in one transaction, all or nothing (a failed
  batch is retried whole, and the ids make that safe).
- ``query`` sums in SQL, grouped by any combination of account, model, UTC day
  and session, over a half-open time range.
- Rows are never updated or deleted: triggers in the database refuse it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from cachet.durable_postgres import is_postgres_url
from cachet.usage.postgres_ledger import PostgresLedger
from cachet.usage.prices import ModelPrice
from cachet.usage.records import RecordOutcome, UsageEntry, UsageQuery, UsageTotals
from cachet.usage.settings import UsageSettings
from cachet.usage.sqlite_ledger import SqliteLedger

DATABASE_NAME = "usage.sqlite3"


class Ledger(Protocol):
    # Where the entries live (a file, or host:port/database), for logs.
    location: str

    async def record(self, entry: UsageEntry, price: ModelPrice) -> RecordOutcome: ...

    async def record_many(self, priced: Sequence[tuple[UsageEntry, ModelPrice]]) -> list[RecordOutcome]: ...

    async def query(self, query: UsageQuery) -> list[UsageTotals]: ...

    async def close(self) -> None: ...


async def open_ledger(settings: UsageSettings) -> Ledger:
    """PostgreSQL when ``store_url`` names a database, else the SQLite file under the data directory."""
    if settings.store_url and is_postgres_url(settings.store_url):
        return await PostgresLedger.open(settings.store_url)
    return await SqliteLedger.open(settings.database or settings.data_dir / DATABASE_NAME)
