"""The durable async queue on PostgreSQL, for routers that share one database.

The contract is ``cachet.router.queue_store``'s and the tables are the SQLite
store's. What SQLite gets from its single writer, this store gets from row locks:

- A lease takes the oldest runnable job of the next account with
  ``FOR UPDATE SKIP LOCKED``: a job another router is leasing right now is skipped,
  never waited for and never handed out twice.
- A completion, cancel or expiry locks its batch's row before it touches the
  batch's jobs, so the call that ends a batch's last job always sees the others'
  ends and finishes the batch exactly once. Groups of completions lock their
  batches in id order, and leases wait on no lock at all, so no two transactions
  can wait on each other.
- ``complete``'s ``UPDATE ... WHERE state != 'done'`` waits for a concurrent update
  of the same job to commit and then re-reads it (read committed), so of two
  routers that ran one job, only the first stores its result.

The store is its concerns side by side, one module each (see ``sqlite_queue_store``),
whose PostgreSQL halves this class joins; this module holds the migrations they share.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from cachet.durable_postgres import PostgresPool, describe, open_pool
from cachet.logs import get_logger
from cachet.router.completion_groups import CompletionGroups
from cachet.router.queue_api_keys import PostgresApiKeys
from cachet.router.queue_batches import PostgresBatches
from cachet.router.queue_files import PostgresFiles
from cachet.router.queue_leases import PostgresLeases
from cachet.router.queue_records import wall_clock_ms
from cachet.router.queue_responses import PostgresResponses
from cachet.router.queue_webhooks import PostgresWebhooks

log = get_logger(__name__)

STORE = "queue"

# Ids compare byte by byte (COLLATE "C"), as SQLite compares them: round-robin by account
# visits accounts in the same order on either store, and the index needs no locale.
MIGRATIONS = [
    (
        1,
        """
CREATE TABLE batches (
    batch_id TEXT PRIMARY KEY,
    account_id TEXT NOT NULL,
    model TEXT NOT NULL,
    webhook_url TEXT NOT NULL,
    jobs INTEGER NOT NULL,
    created_at_ms BIGINT NOT NULL,
    -- Set once, by the complete() that finished the last job.
    finished_at_ms BIGINT,
    -- '' (no webhook), 'pending', 'delivered' or 'failed'.
    webhook_state TEXT NOT NULL DEFAULT '',
    -- When the next delivery attempt is due; doubles as the sender's lease.
    webhook_due_at_ms BIGINT NOT NULL DEFAULT 0
);
CREATE INDEX batches_webhook_due ON batches (webhook_due_at_ms) WHERE webhook_state = 'pending';
CREATE TABLE jobs (
    request_id TEXT PRIMARY KEY,
    batch_id TEXT NOT NULL REFERENCES batches (batch_id),
    position INTEGER NOT NULL,
    account_id TEXT COLLATE "C" NOT NULL,
    -- Serialized cachet.router.v1.QueuedRequest.
    body BYTEA NOT NULL,
    state TEXT NOT NULL DEFAULT 'queued',
    -- Global arrival order; the jobs of one batch take theirs in position order.
    seq BIGINT GENERATED ALWAYS AS IDENTITY,
    lease_owner TEXT NOT NULL DEFAULT '',
    lease_expires_at_ms BIGINT NOT NULL DEFAULT 0,
    attempts INTEGER NOT NULL DEFAULT 0,
    -- Serialized cachet.router.v1.QueuedResult, written once.
    result BYTEA,
    finished_at_ms BIGINT,
    UNIQUE (batch_id, position)
);
-- The dispatcher's question, "what is runnable, per account, oldest first?".
CREATE INDEX jobs_runnable ON jobs (state, account_id, seq);
-- Each completion's question, "is any job of this batch left to end?".
CREATE INDEX jobs_by_batch_state ON jobs (batch_id, state);
CREATE TABLE webhook_attempts (
    batch_id TEXT NOT NULL REFERENCES batches (batch_id),
    attempt INTEGER NOT NULL,
    at_ms BIGINT NOT NULL,
    -- HTTP status of the answer; 0 when there was none (connection failed, timed out).
    http_status INTEGER NOT NULL,
    error TEXT NOT NULL,
    PRIMARY KEY (batch_id, attempt)
);
CREATE TABLE batch_cancellations (
    batch_id TEXT PRIMARY KEY REFERENCES batches (batch_id),
    cancelled_at_ms BIGINT NOT NULL
);
-- OpenAI batches whose completion window ended before they did.
CREATE TABLE batch_expirations (
    batch_id TEXT PRIMARY KEY REFERENCES batches (batch_id),
    expired_at_ms BIGINT NOT NULL
);
CREATE TABLE files (
    file_id TEXT PRIMARY KEY,
    account_id TEXT NOT NULL,
    filename TEXT NOT NULL,
    purpose TEXT NOT NULL,
    created_at_ms BIGINT NOT NULL,
    content BYTEA NOT NULL
);
CREATE TABLE file_batches (
    batch_id TEXT PRIMARY KEY REFERENCES batches (batch_id),
    -- Listing order (newest first), as SQLite's rowid.
    seq BIGINT GENERATED ALWAYS AS IDENTITY,
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
CREATE INDEX file_batches_by_account ON file_batches (account_id, seq);
""",
    ),
    (
        2,
        """
-- Managed API keys (api_keys.py): the key's SHA-256, never the key. Times in Unix ms, 0: never.
CREATE TABLE api_keys (
    key_id TEXT PRIMARY KEY,
    key_hash TEXT NOT NULL,
    account_id TEXT NOT NULL,
    name TEXT NOT NULL,
    created_at_ms BIGINT NOT NULL,
    expires_at_ms BIGINT NOT NULL DEFAULT 0,
    revoked_at_ms BIGINT NOT NULL DEFAULT 0,
    last_used_at_ms BIGINT NOT NULL DEFAULT 0,
    -- Limits; 0: none.
    requests_per_minute BIGINT NOT NULL DEFAULT 0,
    tokens_per_minute BIGINT NOT NULL DEFAULT 0,
    monthly_budget_picousd BIGINT NOT NULL DEFAULT 0
);
CREATE INDEX api_keys_by_account ON api_keys (account_id, created_at_ms);
-- The managed key a batch was queued with: its jobs count against that key's limits when they run.
CREATE TABLE batch_api_keys (
    batch_id TEXT PRIMARY KEY REFERENCES batches (batch_id),
    key_id TEXT NOT NULL
);
""",
    ),
    (
        3,
        """
-- OpenAI Responses' stored responses: the JSON as answered (the bridge's; kept unread) and
-- the session a follow-up runs under. Times in Unix seconds, as OpenAI's created_at.
CREATE TABLE stored_responses (
    account_id TEXT NOT NULL,
    response_id TEXT NOT NULL,
    created_at BIGINT NOT NULL,
    session_id TEXT NOT NULL,
    response BYTEA NOT NULL,
    PRIMARY KEY (account_id, response_id)
);
-- A stored response's input items, one row each in conversation order, so a page of
-- input_items reads only its rows.
CREATE TABLE stored_response_items (
    account_id TEXT NOT NULL,
    response_id TEXT NOT NULL,
    position INTEGER NOT NULL,
    item_id TEXT NOT NULL,
    item BYTEA NOT NULL,
    PRIMARY KEY (account_id, response_id, position)
);
""",
    ),
    (
        4,
        """
-- The retention purge (response_retention.py) takes the oldest responses first.
CREATE INDEX stored_responses_by_age ON stored_responses (created_at);
""",
    ),
]


class PostgresQueueStore(
    PostgresBatches, PostgresLeases, PostgresWebhooks, PostgresFiles, PostgresApiKeys, PostgresResponses
):
    """The queue's durable state in a PostgreSQL database; every method is safe to call concurrently,
    from this process or any other sharing the database."""

    def __init__(
        self, pool: PostgresPool, location: str, clock_ms: Callable[[], int] = wall_clock_ms
    ) -> None:
        # Use ``open``: it applies the migrations first.
        self._pool = pool
        self.location = location
        self._clock_ms = clock_ms
        self._loop = asyncio.get_running_loop()
        self._completions = CompletionGroups(self._write_completions)

    @classmethod
    async def open(cls, url: str, clock_ms: Callable[[], int] = wall_clock_ms) -> PostgresQueueStore:
        pool = await open_pool(url, MIGRATIONS, store=STORE)
        log.info("queue store opened", store="postgresql", database=describe(url))
        return cls(PostgresPool(pool, STORE), describe(url), clock_ms)

    async def close(self) -> None:
        await self._completions.drain()
        await self._pool.close()
