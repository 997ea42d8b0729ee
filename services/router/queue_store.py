"""The durable async queue: batches, their jobs, results, webhook attempts, OpenAI files and batches
(and, beside them, managed API keys and the Responses API's stored responses).

Contract (``SqliteQueueStore``, the embedded default, and ``PostgresQueueStore``, for
routers that share one database, both keep it: the same async methods, the same
tables, the same conditional updates):

- ``create_batch`` stores a batch and one *job* per request in one transaction;
  the batch is durable once the call returns, so the caller may answer "queued".
- ``lease`` hands out one runnable job (queued, or leased by someone whose lease
  expired) to one owner until ``lease_seconds`` from now. A dispatcher that dies
  simply stops renewing; its jobs become runnable again when the lease expires:
  execution is *at least once*.
- ``complete`` writes a job's result with ``UPDATE ... WHERE state != 'done'``:
  of every attempt that finishes, only the first is stored (*exactly once*), and
  only that call sees the batch finish (so the webhook is armed once).
- ``release`` puts a leased job back (no capacity now) without counting an attempt.
- ``expire_file_batches`` does the same for OpenAI batches older than their
  completion window (OpenAI's ``expired``), and marks them expired.
- ``cancel_batch`` ends every job that has not started (state ``cancelled``, with the
  caller's result) in one transaction, so the dispatcher can never lease one of them
  afterwards; jobs already leased finish, and the last of them finishes the batch.
- OpenAI batches are ordinary batches plus a ``file_batches`` row (input file,
  endpoint, custom ids, lines refused at validation); uploaded input files live in
  ``files``. Both are written in the transaction that creates the batch or file.
- Fairness lives here too: ``lease(after_account=...)`` takes the next account
  with work after the one served last (round-robin by account id), and within an
  account the oldest job first.

``complete``'s exactly-once holds across processes: on SQLite because ``BEGIN
IMMEDIATE`` lets one writer in at a time, on PostgreSQL because the conditional
update waits for a concurrent one to commit and then sees its ``done``, and a
completion locks its batch's row first, so the last two jobs of a batch finishing
in two routers at once cannot both miss the end.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from cachet.durable_postgres import is_postgres_url
from cachet.router.api_keys import ApiKey
from cachet.router.postgres_queue_store import PostgresQueueStore
from cachet.router.queue_records import (
    BatchState,
    BatchView,
    Cancellation,
    Completion,
    DueWebhook,
    FileBatchRecord,
    Job,
    JobState,
    ResponseItem,
    StoredFile,
    StoredResponse,
    WebhookAttempt,
)
from cachet.router.settings import RouterSettings
from cachet.router.sqlite_queue_store import SqliteQueueStore

# The domain types are the queue's vocabulary: callers import them from here with the store.
__all__ = [
    "BatchState",
    "BatchView",
    "Cancellation",
    "Completion",
    "DueWebhook",
    "FileBatchRecord",
    "Job",
    "JobState",
    "QueueStore",
    "ResponseItem",
    "StoredFile",
    "StoredResponse",
    "WebhookAttempt",
    "open_queue_store",
]


class QueueStore(Protocol):
    # Where the queue lives (a file, or host:port/database), for logs.
    location: str

    async def close(self) -> None: ...

    async def create_batch(
        self,
        account_id: str,
        model: str,
        bodies: Sequence[bytes],
        webhook_url: str = "",
        file_batch: FileBatchRecord | None = None,
        api_key_id: str = "",
    ) -> str: ...

    async def batch(
        self, batch_id: str, account_id: str, *, results_once_finished: bool = False
    ) -> BatchView | None: ...

    async def cancel_batch(
        self, batch_id: str, account_id: str, cancelled_result: bytes
    ) -> Cancellation | None: ...

    async def expire_file_batches(self, window_ms: int, expired_result: bytes) -> list[str]: ...

    async def lease(self, owner: str, lease_seconds: float, after_account: str = "") -> Job | None: ...

    async def lease_many(
        self, owner: str, lease_seconds: float, after_account: str = "", *, limit: int
    ) -> list[Job]: ...

    async def renew(self, job: Job, lease_seconds: float) -> bool: ...

    async def release(self, job: Job) -> bool: ...

    async def complete(self, job: Job, result: bytes) -> Completion: ...

    async def counts(self) -> dict[str, int]: ...

    def counts_off_the_loop(self, timeout: float) -> dict[str, int]: ...

    async def claim_webhook(self, hold_seconds: float) -> DueWebhook | None: ...

    async def record_webhook_attempt(
        self, batch_id: str, http_status: int, error: str, *, delivered: bool, retry_at_ms: int | None
    ) -> None: ...

    async def webhook_attempts(self, batch_id: str) -> list[WebhookAttempt]: ...

    async def put_file(self, account_id: str, filename: str, purpose: str, content: bytes) -> StoredFile: ...

    async def file(self, file_id: str, account_id: str) -> StoredFile | None: ...

    async def file_content(self, file_id: str, account_id: str) -> bytes | None: ...

    async def file_batch(self, batch_id: str, account_id: str) -> FileBatchRecord | None: ...

    async def file_batch_ids(self, account_id: str, after: str, limit: int) -> tuple[list[str], bool]: ...

    # Managed API keys (api_keys.py) live in the same store, and so does the key a batch was
    # queued with, which its jobs count against when they run.
    async def create_api_key(self, key: ApiKey) -> None: ...

    async def api_key(self, key_id: str) -> ApiKey | None: ...

    async def api_keys(self, account_id: str = "") -> list[ApiKey]: ...

    async def revoke_api_key(self, key_id: str) -> ApiKey | None: ...

    async def touch_api_key(self, key_id: str, at_ms: int) -> None: ...

    async def batch_api_key(self, batch_id: str) -> str: ...

    # OpenAI Responses' stored responses, per account, with their conversations' input items.
    async def put_response(self, account_id: str, response: StoredResponse) -> None: ...

    async def response(
        self, account_id: str, response_id: str, *, with_items: bool = False
    ) -> StoredResponse | None: ...

    async def delete_response(self, account_id: str, response_id: str) -> bool: ...

    async def response_items(
        self, account_id: str, response_id: str, *, newest_first: bool, after: str, limit: int
    ) -> tuple[list[ResponseItem], bool] | None: ...

    async def purge_responses(self, max_age_seconds: int, limit: int) -> int: ...


async def open_queue_store(options: RouterSettings) -> QueueStore:
    """PostgreSQL when ``store_url`` names a database, else the SQLite file under the data directory."""
    if options.store_url and is_postgres_url(options.store_url):
        return await PostgresQueueStore.open(options.store_url)
    return SqliteQueueStore(options.queue_path)
