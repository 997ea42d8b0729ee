"""The durable async queue on SQLite (the embedded default): one file, one worker thread.

The contract is ``cachet.router.queue_store``'s. SQLite is blocking, so, as in the
usage ledger, every call runs on one ``SqliteWorker`` that owns the one connection
(WAL, FULL sync, busy timeout); the event loop only awaits. Writes that must be
atomic run inside ``BEGIN IMMEDIATE``, which takes the write lock up front, so two
routers sharing the file cannot both lease the same job.

The store is its concerns side by side, one module each, whose SQLite halves this
class joins into the one interface the router uses: batches (queue_batches.py),
jobs and leases (queue_leases.py), webhook deliveries (queue_webhooks.py), OpenAI
files and batches (queue_files.py), managed API keys (queue_api_keys.py), stored
responses (queue_responses.py). This module holds the schema they share.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable
from pathlib import Path

from cachet.durable_sqlite import SqliteWorker, open_durable_sqlite
from cachet.router.completion_groups import CompletionGroups
from cachet.router.queue_api_keys import SqliteApiKeys
from cachet.router.queue_batches import SqliteBatches
from cachet.router.queue_files import SqliteFiles
from cachet.router.queue_leases import SqliteLeases
from cachet.router.queue_records import wall_clock_ms
from cachet.router.queue_responses import SqliteResponses
from cachet.router.queue_webhooks import SqliteWebhooks

SCHEMA_VERSION = 1

_SCHEMA = """
CREATE TABLE IF NOT EXISTS batches (
    batch_id TEXT PRIMARY KEY,
    account_id TEXT NOT NULL,
    model TEXT NOT NULL,
    webhook_url TEXT NOT NULL,
    jobs INTEGER NOT NULL,
    created_at_ms INTEGER NOT NULL,
    -- Set once, by the complete() that finished the last job.
    finished_at_ms INTEGER,
    -- '' (no webhook), 'pending', 'delivered' or 'failed'.
    webhook_state TEXT NOT NULL DEFAULT '',
    -- When the next delivery attempt is due; doubles as the sender's lease.
    webhook_due_at_ms INTEGER NOT NULL DEFAULT 0
);
CREATE TABLE IF NOT EXISTS jobs (
    request_id TEXT PRIMARY KEY,
    batch_id TEXT NOT NULL REFERENCES batches (batch_id),
    position INTEGER NOT NULL,
    account_id TEXT NOT NULL,
    -- Serialized cachet.router.v1.QueuedRequest.
    body BLOB NOT NULL,
    state TEXT NOT NULL DEFAULT 'queued',
    -- Global arrival order: rowids of one batch are consecutive.
    seq INTEGER NOT NULL,
    lease_owner TEXT NOT NULL DEFAULT '',
    lease_expires_at_ms INTEGER NOT NULL DEFAULT 0,
    attempts INTEGER NOT NULL DEFAULT 0,
    -- Serialized cachet.router.v1.QueuedResult, written once.
    result BLOB,
    finished_at_ms INTEGER,
    UNIQUE (batch_id, position)
);
-- The dispatcher's question, "what is runnable, per account, oldest first?".
CREATE INDEX IF NOT EXISTS jobs_runnable ON jobs (state, account_id, seq);
-- Each completion's question, "is any job of this batch left to end?".
CREATE INDEX IF NOT EXISTS jobs_by_batch_state ON jobs (batch_id, state);
CREATE TABLE IF NOT EXISTS webhook_attempts (
    batch_id TEXT NOT NULL REFERENCES batches (batch_id),
    attempt INTEGER NOT NULL,
    at_ms INTEGER NOT NULL,
    -- HTTP status of the answer; 0 when there was none (connection failed, timed out).
    http_status INTEGER NOT NULL,
    error TEXT NOT NULL,
    PRIMARY KEY (batch_id, attempt)
);
CREATE TABLE IF NOT EXISTS batch_cancellations (
    batch_id TEXT PRIMARY KEY REFERENCES batches (batch_id),
    cancelled_at_ms INTEGER NOT NULL
);
-- OpenAI batches whose completion window ended before they did.
CREATE TABLE IF NOT EXISTS batch_expirations (
    batch_id TEXT PRIMARY KEY REFERENCES batches (batch_id),
    expired_at_ms INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS files (
    file_id TEXT PRIMARY KEY,
    account_id TEXT NOT NULL,
    filename TEXT NOT NULL,
    purpose TEXT NOT NULL,
    created_at_ms INTEGER NOT NULL,
    content BLOB NOT NULL
);
CREATE TABLE IF NOT EXISTS file_batches (
    batch_id TEXT PRIMARY KEY REFERENCES batches (batch_id),
    account_id TEXT NOT NULL,
    input_file_id TEXT NOT NULL,
    endpoint TEXT NOT NULL,
    completion_window TEXT NOT NULL,
    -- JSON object, as the client gave it.
    metadata TEXT NOT NULL,
    -- JSON list: the custom_id of each job, by position.
    custom_ids TEXT NOT NULL,
    -- JSON list of [custom_id, code, message, line] for lines refused before running.
    rejected TEXT NOT NULL
);
-- Listing an account's batches newest first, paged by rowid.
CREATE INDEX IF NOT EXISTS file_batches_by_account ON file_batches (account_id);
-- Managed API keys (api_keys.py): the key's SHA-256, never the key. Times in Unix ms, 0: never.
CREATE TABLE IF NOT EXISTS api_keys (
    key_id TEXT PRIMARY KEY,
    key_hash TEXT NOT NULL,
    account_id TEXT NOT NULL,
    name TEXT NOT NULL,
    created_at_ms INTEGER NOT NULL,
    expires_at_ms INTEGER NOT NULL DEFAULT 0,
    revoked_at_ms INTEGER NOT NULL DEFAULT 0,
    last_used_at_ms INTEGER NOT NULL DEFAULT 0,
    -- Limits; 0: none.
    requests_per_minute INTEGER NOT NULL DEFAULT 0,
    tokens_per_minute INTEGER NOT NULL DEFAULT 0,
    monthly_budget_picousd INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS api_keys_by_account ON api_keys (account_id, created_at_ms);
-- The managed key a batch was queued with: its jobs count against that key's limits when they run.
CREATE TABLE IF NOT EXISTS batch_api_keys (
    batch_id TEXT PRIMARY KEY REFERENCES batches (batch_id),
    key_id TEXT NOT NULL
);
-- OpenAI Responses' stored responses: the JSON as answered (the bridge's; kept unread) and
-- the session a follow-up runs under. Times in Unix seconds, as OpenAI's created_at.
CREATE TABLE IF NOT EXISTS stored_responses (
    account_id TEXT NOT NULL,
    response_id TEXT NOT NULL,
    created_at INTEGER NOT NULL,
    session_id TEXT NOT NULL,
    response BLOB NOT NULL,
    PRIMARY KEY (account_id, response_id)
);
-- The retention purge takes the oldest first (added after version 1: IF NOT EXISTS is the migration).
CREATE INDEX IF NOT EXISTS stored_responses_by_age ON stored_responses (created_at);
-- A stored response's input items, one row each in conversation order, so a page of
-- input_items reads only its rows.
CREATE TABLE IF NOT EXISTS stored_response_items (
    account_id TEXT NOT NULL,
    response_id TEXT NOT NULL,
    position INTEGER NOT NULL,
    item_id TEXT NOT NULL,
    item BLOB NOT NULL,
    PRIMARY KEY (account_id, response_id, position)
);
"""


def _connect(path: Path) -> sqlite3.Connection:
    return open_durable_sqlite(path, _SCHEMA, SCHEMA_VERSION, what="queue", check_same_thread=False)


class SqliteQueueStore(
    SqliteBatches, SqliteLeases, SqliteWebhooks, SqliteFiles, SqliteApiKeys, SqliteResponses
):
    """The queue's durable state in one SQLite file; every method is safe to call concurrently."""

    def __init__(self, path: Path, clock_ms: Callable[[], int] = wall_clock_ms) -> None:
        self.path = path
        self.location = str(path)
        self._clock_ms = clock_ms
        self._worker = SqliteWorker.start(lambda: _connect(path), name="queue-store")
        self._completions = CompletionGroups(self._write_completions)

    async def close(self) -> None:
        await self._completions.drain()
        await self._worker.close()
