"""The queue's domain types: what a store hands its callers, whichever database is behind it."""

from __future__ import annotations

import json
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import StrEnum


class JobState(StrEnum):
    QUEUED = "queued"
    LEASED = "leased"
    DONE = "done"
    CANCELLED = "cancelled"  # never ran: its batch was cancelled (or expired) first


class BatchState(StrEnum):
    QUEUED = "queued"  # no job has started
    RUNNING = "running"  # some job started or finished, not all finished
    DONE = "done"  # every job finished (with a result or an error)
    CANCELLING = "cancelling"  # cancelled; jobs that had started are still running
    CANCELLED = "cancelled"  # cancelled, and every started job finished
    EXPIRING = "expiring"  # its completion window ended; jobs that had started are still running
    EXPIRED = "expired"  # its completion window ended, and every started job finished


@dataclass(frozen=True)
class Job:
    """One leased request. ``attempt`` counts leases, this one included."""

    request_id: str
    batch_id: str
    position: int
    account_id: str
    body: bytes
    owner: str
    attempt: int


@dataclass(frozen=True)
class BatchView:
    """A batch as its owner sees it; ``results`` are ``None`` for unfinished jobs, and empty
    when the reader asked for them only once the batch finished and it has not."""

    batch_id: str
    account_id: str
    model: str
    state: BatchState
    results: list[bytes | None]
    webhook_url: str
    webhook_state: str
    created_at_ms: int = 0
    finished_at_ms: int | None = None
    cancelled_at_ms: int | None = None
    # Per job, by position: a JobState value.
    job_states: list[str] = field(default_factory=list)
    expired_at_ms: int | None = None

    @property
    def finished(self) -> bool:
        return self.finished_at_ms is not None


@dataclass(frozen=True)
class FileBatchRecord:
    """What an OpenAI batch adds to a queued batch."""

    input_file_id: str
    endpoint: str
    completion_window: str
    metadata: dict[str, str]
    custom_ids: list[str]
    # (custom_id, code, message, line) of each line refused before running.
    rejected: list[tuple[str, str, str, int]]

    @classmethod
    def from_stored(
        cls, input_file_id: str, endpoint: str, window: str, metadata: str, custom_ids: str, rejected: str
    ) -> FileBatchRecord:
        """From a store's row, whose last three columns are JSON text (both stores keep them so)."""
        return cls(
            input_file_id,
            endpoint,
            window,
            json.loads(metadata),
            json.loads(custom_ids),
            [tuple(line) for line in json.loads(rejected)],
        )


@dataclass(frozen=True)
class StoredFile:
    file_id: str
    account_id: str
    filename: str
    purpose: str
    created_at_ms: int
    size: int


@dataclass(frozen=True)
class Cancellation:
    """What ``cancel_batch`` did: jobs it ended, and whether that finished the batch."""

    cancelled_jobs: int
    batch_finished: bool


@dataclass(frozen=True)
class Completion:
    """What ``complete`` did: whether this call stored the result, and whether it finished the batch."""

    stored: bool
    batch_finished: bool


@dataclass(frozen=True)
class DueWebhook:
    batch_id: str
    account_id: str
    url: str
    finished_at_ms: int
    attempts: int


@dataclass(frozen=True)
class WebhookAttempt:
    attempt: int
    at_ms: int
    http_status: int
    error: str


@dataclass(frozen=True)
class ResponseItem:
    """One input item of a stored response's conversation."""

    item_id: str
    # OpenAI's JSON for the item: the bridge's to read, the store's only to keep.
    body: bytes


@dataclass(frozen=True)
class StoredResponse:
    """A response of OpenAI's Responses API kept for ``previous_response_id`` and ``GET``."""

    response_id: str
    created_at: int  # Unix seconds
    # The session that placed it: its follow-ups run under it, on the replica holding its KV.
    session_id: str
    # The Response object as answered (OpenAI's JSON, kept unread).
    body: bytes
    # The conversation before its output, oldest first; empty when read without them.
    input_items: tuple[ResponseItem, ...] = ()


def batch_state(
    finished_at_ms: int | None,
    cancelled_at_ms: int | None,
    expired_at_ms: int | None,
    job_states: Iterable[str],
) -> BatchState:
    """A batch's state from its end times and its jobs' states (both stores derive it so)."""
    if expired_at_ms is not None:
        return BatchState.EXPIRED if finished_at_ms is not None else BatchState.EXPIRING
    if cancelled_at_ms is not None:
        return BatchState.CANCELLED if finished_at_ms is not None else BatchState.CANCELLING
    if finished_at_ms is not None:
        return BatchState.DONE
    if any(state != JobState.QUEUED for state in job_states):
        return BatchState.RUNNING
    return BatchState.QUEUED


def wall_clock_ms() -> int:
    """The stores' default clock (tests pass one they can set)."""
    return int(time.time() * 1000)
