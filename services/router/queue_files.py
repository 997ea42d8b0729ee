"""OpenAI files and batches in the queue's database.

An uploaded input file is one ``files`` row. An OpenAI batch is an ordinary queued
batch (queue_batches.py) plus a ``file_batches`` row: input file, endpoint, custom ids,
and the lines refused at validation, written in the transaction that creates the
batch. Both stores run the same statements, except how a listing pages: by SQLite's
rowid, by PostgreSQL's ``seq``.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable

from cachet.durable_postgres import PostgresPool
from cachet.durable_sqlite import SqliteWorker, for_sqlite
from cachet.router.queue_records import FileBatchRecord, StoredFile

_PUT_FILE = (
    "INSERT INTO files (file_id, account_id, filename, purpose, created_at_ms, content)"
    " VALUES ($1, $2, $3, $4, $5, $6)"
)
_FILE = (
    "SELECT file_id, account_id, filename, purpose, created_at_ms, LENGTH(content) FROM files"
    " WHERE file_id = $1 AND account_id = $2"
)
_FILE_CONTENT = "SELECT content FROM files WHERE file_id = $1 AND account_id = $2"
_FILE_BATCH = (
    "SELECT input_file_id, endpoint, completion_window, metadata, custom_ids, rejected"
    " FROM file_batches WHERE batch_id = $1 AND account_id = $2"
)
INSERT_FILE_BATCH = (
    "INSERT INTO file_batches (batch_id, account_id, input_file_id, endpoint, completion_window, metadata,"
    " custom_ids, rejected) VALUES ($1, $2, $3, $4, $5, $6, $7, $8)"
)
# Newest first, older than batch $2 (none: from the newest); a row past the limit says more follow.
_FILE_BATCH_IDS = (
    "SELECT batch_id FROM file_batches WHERE account_id = $1"
    " AND ($2 = '' OR {order} < (SELECT {order} FROM file_batches WHERE batch_id = $2))"
    " ORDER BY {order} DESC LIMIT $3"
)


def file_batch_row(batch_id: str, account_id: str, record: FileBatchRecord) -> tuple:
    """``INSERT_FILE_BATCH``'s parameters: the lists and the metadata as JSON text, in both stores."""
    return (
        batch_id,
        account_id,
        record.input_file_id,
        record.endpoint,
        record.completion_window,
        json.dumps(record.metadata),
        json.dumps(record.custom_ids),
        json.dumps([list(line) for line in record.rejected]),
    )


def _new_file_id() -> str:
    return f"file-{uuid.uuid4().hex}"


class SqliteFiles:
    """The SQLite store's files and OpenAI batches; ``SqliteQueueStore`` supplies the worker and the clock."""

    _worker: SqliteWorker
    _clock_ms: Callable[[], int]

    async def put_file(self, account_id: str, filename: str, purpose: str, content: bytes) -> StoredFile:
        """Store an uploaded file; durable once this returns."""
        file_id, now = _new_file_id(), self._clock_ms()
        row = (file_id, account_id, filename, purpose, now, content)
        await self._worker.run(lambda db: db.execute(for_sqlite(_PUT_FILE), row))
        return StoredFile(file_id, account_id, filename, purpose, now, len(content))

    async def file(self, file_id: str, account_id: str) -> StoredFile | None:
        """The file if it exists *and* belongs to ``account_id``."""
        row = await self._worker.run(
            lambda db: db.execute(for_sqlite(_FILE), (file_id, account_id)).fetchone()
        )
        return None if row is None else StoredFile(*row)

    async def file_content(self, file_id: str, account_id: str) -> bytes | None:
        row = await self._worker.run(
            lambda db: db.execute(for_sqlite(_FILE_CONTENT), (file_id, account_id)).fetchone()
        )
        return None if row is None else row[0]

    async def file_batch(self, batch_id: str, account_id: str) -> FileBatchRecord | None:
        """The OpenAI part of a batch of ``account_id``; None for another's or a plain queued batch."""
        row = await self._worker.run(
            lambda db: db.execute(for_sqlite(_FILE_BATCH), (batch_id, account_id)).fetchone()
        )
        return None if row is None else FileBatchRecord.from_stored(*row)

    async def file_batch_ids(self, account_id: str, after: str, limit: int) -> tuple[list[str], bool]:
        """Up to ``limit`` OpenAI batch ids of the account, newest first, older than ``after``; and whether more follow."""
        page = for_sqlite(_FILE_BATCH_IDS.format(order="rowid"))
        rows = await self._worker.run(lambda db: db.execute(page, (account_id, after, limit + 1)).fetchall())
        return [row[0] for row in rows[:limit]], len(rows) > limit


class PostgresFiles:
    """The PostgreSQL store's files and OpenAI batches; ``PostgresQueueStore`` supplies the pool and the clock."""

    _pool: PostgresPool
    _clock_ms: Callable[[], int]

    async def put_file(self, account_id: str, filename: str, purpose: str, content: bytes) -> StoredFile:
        """Store an uploaded file; durable once this returns."""
        file_id, now = _new_file_id(), self._clock_ms()
        async with self._pool.connection() as db:
            await db.execute(_PUT_FILE, file_id, account_id, filename, purpose, now, content)
        return StoredFile(file_id, account_id, filename, purpose, now, len(content))

    async def file(self, file_id: str, account_id: str) -> StoredFile | None:
        """The file if it exists *and* belongs to ``account_id``."""
        async with self._pool.connection() as db:
            row = await db.fetchrow(_FILE, file_id, account_id)
        return None if row is None else StoredFile(*row)

    async def file_content(self, file_id: str, account_id: str) -> bytes | None:
        async with self._pool.connection() as db:
            return await db.fetchval(_FILE_CONTENT, file_id, account_id)

    async def file_batch(self, batch_id: str, account_id: str) -> FileBatchRecord | None:
        """The OpenAI part of a batch of ``account_id``; None for another's or a plain queued batch."""
        async with self._pool.connection() as db:
            row = await db.fetchrow(_FILE_BATCH, batch_id, account_id)
        return None if row is None else FileBatchRecord.from_stored(*row)

    async def file_batch_ids(self, account_id: str, after: str, limit: int) -> tuple[list[str], bool]:
        """Up to ``limit`` OpenAI batch ids of the account, newest first, older than ``after``; and whether more follow."""
        async with self._pool.connection() as db:
            rows = await db.fetch(_FILE_BATCH_IDS.format(order="seq"), account_id, after, limit + 1)
        return [row[0] for row in rows[:limit]], len(rows) > limit
