"""Pydantic models of the OpenAI Files and Batch API bodies (requests checked, answers described).

Kept apart from ``schemas.py`` (the completions API): a batch is a different
resource with its own lifecycle, and these shapes are OpenAI's ``File``,
``Batch`` and batch-input-line objects, field for field.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

BatchEndpoint = Literal["/v1/chat/completions", "/v1/completions"]
BatchStatus = Literal[
    "validating", "failed", "in_progress", "finalizing", "completed", "expired", "cancelling", "cancelled"
]


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class _Answer(BaseModel):
    model_config = ConfigDict(extra="forbid")


class BatchCreateBody(_Body):
    input_file_id: str = Field(min_length=1)
    endpoint: BatchEndpoint
    completion_window: Literal["24h"]
    metadata: dict[str, str] | None = None
    # Cachet extension: called when the batch ends (else the account's default webhook).
    webhook_url: str | None = None


class BatchInputLine(_Body):
    """One line of an input file; ``body`` is checked against the endpoint's own request model."""

    custom_id: str = Field(min_length=1)
    method: Literal["POST"]
    url: BatchEndpoint
    body: dict[str, Any]


class FileObject(_Answer):
    id: str
    object: Literal["file"]
    bytes: int
    created_at: int
    filename: str
    purpose: str
    # Deprecated by OpenAI but still sent: a stored file is always processed.
    status: Literal["processed"]


class RequestCounts(_Answer):
    total: int
    completed: int
    failed: int


class BatchLineErrorOut(_Answer):
    code: str
    message: str
    param: str | None = None
    line: int | None = None


class BatchErrors(_Answer):
    object: Literal["list"]
    data: list[BatchLineErrorOut]


class InputTokensDetails(_Answer):
    cached_tokens: int


class OutputTokensDetails(_Answer):
    reasoning_tokens: int


class BatchUsage(_Answer):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class BatchObject(_Answer):
    id: str
    object: Literal["batch"]
    endpoint: str
    model: str | None
    errors: BatchErrors | None
    input_file_id: str
    completion_window: str
    status: BatchStatus
    output_file_id: str | None
    error_file_id: str | None
    created_at: int
    in_progress_at: int | None
    expires_at: int | None
    finalizing_at: int | None
    completed_at: int | None
    failed_at: int | None
    expired_at: int | None
    cancelling_at: int | None
    cancelled_at: int | None
    request_counts: RequestCounts
    usage: BatchUsage
    metadata: dict[str, str] | None


class BatchList(_Answer):
    object: Literal["list"]
    data: list[BatchObject]
    first_id: str | None
    last_id: str | None
    has_more: bool


class WebhookAttemptObject(_Answer):
    """One call of a batch's webhook (a Cachet extension; OpenAI has no such resource)."""

    object: Literal["webhook_attempt"]
    attempt: int = Field(description="1 for the first call, then one more per retry.")
    at: int = Field(description="When the call was made, Unix time in milliseconds.")
    http_status: int | None = Field(description="The receiver's HTTP status; null when no answer came.")
    error: str | None = Field(description="Why the attempt failed; null when it succeeded.")


class WebhookAttemptList(_Answer):
    object: Literal["list"]
    webhook_url: str | None = Field(description="Where the batch's end is announced; null: nowhere.")
    state: Literal["pending", "delivered", "failed"] | None = Field(
        description="null while the batch runs, or when it has no webhook."
    )
    data: list[WebhookAttemptObject]


class BatchResponseOut(_Answer):
    status_code: int
    request_id: str
    body: dict[str, Any]


class BatchOutputLine(_Answer):
    """A line of an output or error file."""

    id: str
    custom_id: str
    response: BatchResponseOut | None
    error: BatchLineErrorOut | None
