"""OpenAI Responses' stored responses in the queue's database, per account, with their input items.

A response is one row (the JSON as answered, kept unread, and the session a follow-up
runs under); its conversation's input items are one row each, in order, so that a page
of ``input_items`` reads only its rows. Both stores run the same statements, except
how the items go in. Responses older than the router's retention are purged
(``response_retention.py``), a batch of them at a time.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable, Sequence

from cachet.durable_postgres import PostgresPool, Row, rows_affected
from cachet.durable_sqlite import SqliteWorker, for_sqlite
from cachet.router.queue_records import ResponseItem, StoredResponse

_DELETE_ITEMS = "DELETE FROM stored_response_items WHERE account_id = $1 AND response_id = $2"
_PUT = (
    "INSERT INTO stored_responses (account_id, response_id, created_at, session_id, response)"
    " VALUES ($1, $2, $3, $4, $5) ON CONFLICT (account_id, response_id) DO UPDATE SET"
    " created_at = EXCLUDED.created_at, session_id = EXCLUDED.session_id, response = EXCLUDED.response"
)
_GET = (
    "SELECT created_at, session_id, response FROM stored_responses WHERE account_id = $1 AND response_id = $2"
)
_ITEMS = "SELECT item_id, item FROM stored_response_items WHERE account_id = $1 AND response_id = $2 ORDER BY position"
_DELETE = "DELETE FROM stored_responses WHERE account_id = $1 AND response_id = $2"
_OF_RESPONSE = "account_id = $1 AND response_id = $2"
# The oldest responses created before $1, at most $2 of them (the created_at index walks them in order).
_EXPIRED = (
    "SELECT account_id, response_id FROM stored_responses WHERE created_at < $1 ORDER BY created_at LIMIT $2"
)
_PURGE_ITEMS = f"DELETE FROM stored_response_items WHERE (account_id, response_id) IN ({_EXPIRED})"
_PURGE = f"DELETE FROM stored_responses WHERE (account_id, response_id) IN ({_EXPIRED})"


def _page_start(newest_first: bool) -> str:
    """Where a page past item $3 starts: the item's position (the last one of that id in the order asked)."""
    pick = "MAX" if newest_first else "MIN"
    return f"SELECT {pick}(position) FROM stored_response_items WHERE {_OF_RESPONSE} AND item_id = $3"


def _page(newest_first: bool, *, bounded: bool) -> str:
    """A page's items (a row past ``limit`` says more follow): from the first, or past position $3."""
    direction, compare = ("DESC", "<") if newest_first else ("ASC", ">")
    bound, limit = (f" AND position {compare} $3", "$4") if bounded else ("", "$3")
    return (
        f"SELECT item_id, item FROM stored_response_items WHERE {_OF_RESPONSE}{bound}"
        f" ORDER BY position {direction} LIMIT {limit}"
    )


def _stored(response_id: str, row: Row, items: Sequence[Row]) -> StoredResponse:
    # ``row`` holds exactly the fields between the id and the items; mypy cannot count a starred row.
    return StoredResponse(response_id, *row, input_items=tuple(ResponseItem(*item) for item in items))  # type: ignore[misc]


def _items_page(rows: Sequence[Row], limit: int) -> tuple[list[ResponseItem], bool]:
    return [ResponseItem(*row) for row in rows[:limit]], len(rows) > limit


class SqliteResponses:
    """The SQLite store's stored responses; ``SqliteQueueStore`` supplies the worker."""

    _worker: SqliteWorker
    _clock_ms: Callable[[], int]

    async def put_response(self, account_id: str, response: StoredResponse) -> None:
        """Store ``response`` with its input items, replacing one of the same id; durable once this returns."""

        def put(db: sqlite3.Connection) -> None:
            key = (account_id, response.response_id)
            db.execute(for_sqlite(_DELETE_ITEMS), key)
            db.execute(for_sqlite(_PUT), (*key, response.created_at, response.session_id, response.body))
            db.executemany(
                "INSERT INTO stored_response_items (account_id, response_id, position, item_id, item)"
                " VALUES (?, ?, ?, ?, ?)",
                [(*key, n, item.item_id, item.body) for n, item in enumerate(response.input_items)],
            )

        await self._worker.write(put)

    async def response(
        self, account_id: str, response_id: str, *, with_items: bool = False
    ) -> StoredResponse | None:
        """The account's stored response of that id (None for another account's)."""

        def read(db: sqlite3.Connection) -> StoredResponse | None:
            key = (account_id, response_id)
            row = db.execute(for_sqlite(_GET), key).fetchone()
            if row is None:
                return None
            items = db.execute(for_sqlite(_ITEMS), key).fetchall() if with_items else ()
            return _stored(response_id, row, items)

        # One read transaction: a put committing between the two selects is not half seen.
        return await self._worker.read(read)

    async def delete_response(self, account_id: str, response_id: str) -> bool:
        """Forget the account's stored response and its items; False if it had none of that id."""

        def delete(db: sqlite3.Connection) -> bool:
            key = (account_id, response_id)
            db.execute(for_sqlite(_DELETE_ITEMS), key)
            return db.execute(for_sqlite(_DELETE), key).rowcount > 0

        return await self._worker.write(delete)

    async def response_items(
        self, account_id: str, response_id: str, *, newest_first: bool, after: str, limit: int
    ) -> tuple[list[ResponseItem], bool] | None:
        """Up to ``limit`` input items in the order asked, past the item ``after`` (none: from the
        first), and whether more follow; None when ``after`` names no item of that response."""

        def page(db: sqlite3.Connection) -> tuple[list[ResponseItem], bool] | None:
            key = (account_id, response_id)
            if not after:
                return _items_page(
                    db.execute(for_sqlite(_page(newest_first, bounded=False)), (*key, limit + 1)).fetchall(),
                    limit,
                )
            start = db.execute(for_sqlite(_page_start(newest_first)), (*key, after)).fetchone()[0]
            if start is None:
                return None
            rows = db.execute(
                for_sqlite(_page(newest_first, bounded=True)), (*key, start, limit + 1)
            ).fetchall()
            return _items_page(rows, limit)

        return await self._worker.run(page)

    async def purge_responses(self, max_age_seconds: int, limit: int) -> int:
        """Delete up to ``limit`` of the oldest responses created more than ``max_age_seconds`` ago
        (by the store's clock), with their items; how many went."""
        bound = (self._clock_ms() // 1000 - max_age_seconds, limit)

        def purge(db: sqlite3.Connection) -> int:
            # Items first: the responses' rows are what names them.
            db.execute(for_sqlite(_PURGE_ITEMS), bound)
            return db.execute(for_sqlite(_PURGE), bound).rowcount

        return await self._worker.write(purge)


class PostgresResponses:
    """The PostgreSQL store's stored responses; ``PostgresQueueStore`` supplies the pool."""

    _pool: PostgresPool
    _clock_ms: Callable[[], int]

    async def put_response(self, account_id: str, response: StoredResponse) -> None:
        """Store ``response`` with its input items, replacing one of the same id; durable once this returns."""
        key = (account_id, response.response_id)
        items = response.input_items
        async with self._pool.transaction() as db:
            await db.execute(_DELETE_ITEMS, *key)
            await db.execute(_PUT, *key, response.created_at, response.session_id, response.body)
            # One statement for the lot, however long the conversation.
            await db.execute(
                "INSERT INTO stored_response_items (account_id, response_id, position, item_id, item)"
                " SELECT $1, $2, position - 1, item_id, item"
                " FROM unnest($3::text[], $4::bytea[]) WITH ORDINALITY AS items (item_id, item, position)",
                *key,
                [item.item_id for item in items],
                [item.body for item in items],
            )

    async def response(
        self, account_id: str, response_id: str, *, with_items: bool = False
    ) -> StoredResponse | None:
        """The account's stored response of that id (None for another account's)."""
        key = (account_id, response_id)
        # One snapshot for both selects: a put committing between them is not half seen.
        async with self._pool.snapshot() as db:
            row = await db.fetchrow(_GET, *key)
            if row is None:
                return None
            items = await db.fetch(_ITEMS, *key) if with_items else []
        return _stored(response_id, row, items)

    async def delete_response(self, account_id: str, response_id: str) -> bool:
        """Forget the account's stored response and its items; False if it had none of that id."""
        async with self._pool.transaction() as db:
            await db.execute(_DELETE_ITEMS, account_id, response_id)
            status = await db.execute(_DELETE, account_id, response_id)
        return rows_affected(status) > 0

    async def response_items(
        self, account_id: str, response_id: str, *, newest_first: bool, after: str, limit: int
    ) -> tuple[list[ResponseItem], bool] | None:
        """Up to ``limit`` input items in the order asked, past the item ``after`` (none: from the
        first), and whether more follow; None when ``after`` names no item of that response."""
        key = (account_id, response_id)
        async with self._pool.snapshot() as db:
            if not after:
                return _items_page(await db.fetch(_page(newest_first, bounded=False), *key, limit + 1), limit)
            start = await db.fetchval(_page_start(newest_first), *key, after)
            if start is None:
                return None
            rows = await db.fetch(_page(newest_first, bounded=True), *key, start, limit + 1)
        return _items_page(rows, limit)

    async def purge_responses(self, max_age_seconds: int, limit: int) -> int:
        """Delete up to ``limit`` of the oldest responses created more than ``max_age_seconds`` ago
        (by the store's clock), with their items; how many went."""
        bound = (self._clock_ms() // 1000 - max_age_seconds, limit)
        async with self._pool.transaction() as db:
            await db.execute(_PURGE_ITEMS, *bound)
            status = await db.execute(_PURGE, *bound)
        return rows_affected(status)
