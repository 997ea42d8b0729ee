"""The OpenAI Files and Batch APIs on the async queue: input files, batches, their results.

The bridge parses an input file's JSON lines into typed requests (OpenAI's JSON is
its business) and sends them with ``CreateBatch``; here each line is validated as a
queued request would be, the good ones become one queued batch (so the dispatcher,
leases, exactly-once results, cancel and webhooks are the queue's), and the refused
ones are kept with the batch for its error file. A batch is never refused for a bad
line: only when no line can run does it end ``failed``.

Output and error files are not stored: ``file-output-<batch id>`` and
``file-errors-<batch id>`` name the batch's results, which ``GetFileContent`` hands
to the bridge to render. Hence ``validating`` (done before ``CreateBatch`` answers)
is never observed, and ``finalizing`` only while a batch whose 24 h window ended
waits for its started lines (then it is ``expired``).

``request_counts``: ``total`` is every line of the input file, ``completed`` the
lines that answered, ``failed`` those refused or failed while running. Lines a
cancel or the window's end kept from running are in neither (and in the error
file as ``batch_cancelled`` / ``batch_expired``), just as the usage ledger holds
only what ran.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence

from cachet.common.v1 import common_pb2
from cachet.errors import CachetError, InvalidArgument, NotFound
from cachet.router.batch_queue import BatchQueue, validate_one
from cachet.router.caller import Caller
from cachet.router.queue_store import (
    BatchState,
    BatchView,
    FileBatchRecord,
    JobState,
    QueueStore,
    StoredFile,
)
from cachet.router.v1 import router_pb2

BATCH_PURPOSE = "batch"
OUTPUT_PURPOSE = "batch_output"
ENDPOINTS = {"/v1/chat/completions": "chat", "/v1/completions": "completion"}
COMPLETION_WINDOW = "24h"
COMPLETION_WINDOW_SECONDS = 24 * 3600
_OUTPUT_PREFIX = "file-output-"
_ERRORS_PREFIX = "file-errors-"
# OpenAI's limits on batch metadata.
_METADATA_PAIRS, _METADATA_KEY_CHARS, _METADATA_VALUE_CHARS = 16, 64, 512
_DEFAULT_PAGE, _MAX_PAGE = 20, 100

_NOT_CANCELLABLE = (
    router_pb2.OPEN_AI_BATCH_STATUS_COMPLETED,
    router_pb2.OPEN_AI_BATCH_STATUS_FAILED,
    router_pb2.OPEN_AI_BATCH_STATUS_FINALIZING,
    router_pb2.OPEN_AI_BATCH_STATUS_EXPIRED,
)
_STATUSES = {
    BatchState.QUEUED: router_pb2.OPEN_AI_BATCH_STATUS_IN_PROGRESS,
    BatchState.RUNNING: router_pb2.OPEN_AI_BATCH_STATUS_IN_PROGRESS,
    BatchState.DONE: router_pb2.OPEN_AI_BATCH_STATUS_COMPLETED,
    BatchState.CANCELLING: router_pb2.OPEN_AI_BATCH_STATUS_CANCELLING,
    BatchState.CANCELLED: router_pb2.OPEN_AI_BATCH_STATUS_CANCELLED,
    # Its window ended: lines not started never run; started ones finish, and their results
    # are in the output file once the batch is ``expired``.
    BatchState.EXPIRING: router_pb2.OPEN_AI_BATCH_STATUS_FINALIZING,
    BatchState.EXPIRED: router_pb2.OPEN_AI_BATCH_STATUS_EXPIRED,
}


class FileBatches:
    def __init__(self, store: QueueStore, queue: BatchQueue, max_lines: int) -> None:
        self._store = store
        self._queue = queue
        self._max_lines = max_lines

    # ------------------------------------------------------------------ files

    async def upload(self, request: router_pb2.UploadFileRequest, caller: Caller) -> router_pb2.File:
        if request.purpose != BATCH_PURPOSE:
            raise InvalidArgument(f"purpose must be {BATCH_PURPOSE!r}", param="purpose")
        if not request.content.strip():
            raise InvalidArgument("the file is empty", param="file")
        stored = await self._store.put_file(
            caller.account_id, request.filename or "input.jsonl", request.purpose, request.content
        )
        return _file(stored)

    async def get_file(self, request: router_pb2.GetFileRequest, caller: Caller) -> router_pb2.File:
        results = await self._results_file(request.file_id, caller)
        if results is not None:
            batch, kind = results
            return router_pb2.File(
                id=request.file_id,
                created_at=(batch.finished_at_ms or 0) // 1000,
                filename=f"{batch.batch_id}_{kind}.jsonl",
                purpose=OUTPUT_PURPOSE,
            )
        stored = await self._store.file(request.file_id, caller.account_id)
        if stored is None:
            raise _no_file(request.file_id)
        return _file(stored)

    async def get_file_content(
        self, request: router_pb2.GetFileRequest, caller: Caller
    ) -> router_pb2.FileContent:
        results = await self._results_file(request.file_id, caller)
        if results is not None:
            batch, kind = results
            record = await self._record(batch.batch_id, caller)
            lines = _output_lines(batch, record) if kind == "output" else _error_lines(batch, record)
            return router_pb2.FileContent(
                batch_results=router_pb2.BatchResults(batch_id=batch.batch_id, lines=lines)
            )
        content = await self._store.file_content(request.file_id, caller.account_id)
        if content is None:
            raise _no_file(request.file_id)
        return router_pb2.FileContent(data=content)

    async def _results_file(self, file_id: str, caller: Caller) -> tuple[BatchView, str] | None:
        """(batch, "output" | "errors") for a batch's results file; None for any other id."""
        for prefix, kind in ((_OUTPUT_PREFIX, "output"), (_ERRORS_PREFIX, "errors")):
            if file_id.startswith(prefix):
                batch = await self._store.batch(file_id.removeprefix(prefix), caller.account_id)
                record = await self._store.file_batch(file_id.removeprefix(prefix), caller.account_id)
                if batch is None or record is None:
                    raise _no_file(file_id)
                reply = _batch(batch, record)
                if file_id not in (reply.output_file_id, reply.error_file_id):
                    raise _no_file(file_id)  # not finished, or nothing of that kind
                return batch, kind
        return None

    # ---------------------------------------------------------------- batches

    async def create(self, request: router_pb2.CreateBatchRequest, caller: Caller) -> router_pb2.Batch:
        self._validate(request)
        stored = await self._store.file(request.input_file_id, caller.account_id)
        if stored is None or stored.purpose != BATCH_PURPOSE:
            raise NotFound(f"no batch input file {request.input_file_id!r}", param="input_file_id")
        model = _batch_model(request.lines)
        if model:
            self._queue.check_model_served(model)
        accepted, rejected = _sort_lines(request, model)
        record = FileBatchRecord(
            input_file_id=request.input_file_id,
            endpoint=request.endpoint,
            completion_window=request.completion_window,
            metadata=dict(request.metadata),
            custom_ids=[line.custom_id for line in accepted],
            rejected=rejected,
        )
        batch_id = await self._store.create_batch(
            caller.account_id,
            model,
            [line.request.SerializeToString() for line in accepted],
            await self._queue.webhook_for(caller, request.webhook_url),
            record,
            api_key_id=caller.api_key_id,
        )
        return await self._view(batch_id, caller)

    async def get(self, request: router_pb2.GetBatchRequest, caller: Caller) -> router_pb2.Batch:
        return await self._view(request.batch_id, caller)

    async def cancel(self, request: router_pb2.GetBatchRequest, caller: Caller) -> router_pb2.Batch:
        before = await self._view(request.batch_id, caller)  # a plain queued batch is not an OpenAI batch
        if before.status in _NOT_CANCELLABLE:
            # As OpenAI answers: a batch that ended is not cancelled after the fact (a cancelled
            # one is, again, at no cost: the answer is the batch as it stands).
            status = router_pb2.OpenAIBatchStatus.Name(before.status).removeprefix("OPEN_AI_BATCH_STATUS_")
            raise InvalidArgument(f"Cannot cancel a batch with status '{status.lower()}'.", param="batch_id")
        await self._queue.cancel(router_pb2.CancelQueuedBatchRequest(request_id=request.batch_id), caller)
        return await self._view(request.batch_id, caller)

    async def list(
        self, request: router_pb2.ListBatchesRequest, caller: Caller
    ) -> router_pb2.ListBatchesResponse:
        if request.limit > _MAX_PAGE:
            raise InvalidArgument(f"limit is 1 to {_MAX_PAGE}", param="limit")
        ids, has_more = await self._store.file_batch_ids(
            caller.account_id, request.after, request.limit or _DEFAULT_PAGE
        )
        return router_pb2.ListBatchesResponse(
            batches=[await self._view(batch_id, caller) for batch_id in ids], has_more=has_more
        )

    async def _view(self, batch_id: str, caller: Caller) -> router_pb2.Batch:
        record = await self._record(batch_id, caller)
        batch = await self._store.batch(batch_id, caller.account_id)
        assert batch is not None  # its file_batches row is written with it
        return _batch(batch, record)

    async def _record(self, batch_id: str, caller: Caller) -> FileBatchRecord:
        record = await self._store.file_batch(batch_id, caller.account_id)
        if record is None:
            raise NotFound(f"no batch {batch_id!r}", param="batch_id")
        return record

    def _validate(self, request: router_pb2.CreateBatchRequest) -> None:
        if request.endpoint not in ENDPOINTS:
            raise InvalidArgument(f"endpoint must be one of {', '.join(ENDPOINTS)}", param="endpoint")
        if request.completion_window != COMPLETION_WINDOW:
            raise InvalidArgument(
                f"completion_window must be {COMPLETION_WINDOW!r}", param="completion_window"
            )
        if len(request.metadata) > _METADATA_PAIRS or any(
            len(key) > _METADATA_KEY_CHARS or len(value) > _METADATA_VALUE_CHARS
            for key, value in request.metadata.items()
        ):
            raise InvalidArgument(
                f"metadata holds at most {_METADATA_PAIRS} pairs, keys up to {_METADATA_KEY_CHARS} characters"
                f" and values up to {_METADATA_VALUE_CHARS}",
                param="metadata",
            )
        lines = len(request.lines) + len(request.rejected)
        if not 1 <= lines <= self._max_lines:
            raise InvalidArgument(f"an input file holds 1 to {self._max_lines} lines", param="input_file_id")


def _batch_model(lines: Sequence[router_pb2.BatchLine]) -> str:
    """The model of the first line that names one: a batch runs one model, as OpenAI's do."""
    for line in lines:
        kind = line.request.WhichOneof("body")
        if kind is not None and getattr(line.request, kind).model:
            return getattr(line.request, kind).model
    return ""


def _sort_lines(
    request: router_pb2.CreateBatchRequest, model: str
) -> tuple[list[router_pb2.BatchLine], list[tuple[str, str, str, int]]]:
    """The lines that will run, and (custom_id, code, message, line) of those refused."""
    rejected = [
        (r.custom_id, r.error.code or "invalid_request", r.error.message, r.error.line)
        for r in request.rejected
    ]
    seen = collections.Counter(line.custom_id for line in request.lines)
    accepted = []
    for line in request.lines:
        where = f"line {line.line}"
        try:
            if not line.custom_id:
                raise InvalidArgument(f"{where}: custom_id is required", param="custom_id")
            if seen[line.custom_id] > 1:
                raise InvalidArgument(
                    f"{where}: custom_id {line.custom_id!r} is not unique", param="custom_id"
                )
            if line.request.WhichOneof("body") != ENDPOINTS[request.endpoint]:
                raise InvalidArgument(f"{where}: every line must call {request.endpoint}", param="url")
            validate_one(where, line.request, model)
        except CachetError as error:
            rejected.append((line.custom_id, "invalid_request", error.message, line.line))
            continue
        accepted.append(line)
    rejected.sort(key=lambda refused: refused[3])
    return accepted, rejected


def _batch(batch: BatchView, record: FileBatchRecord) -> router_pb2.Batch:
    results = [router_pb2.QueuedResult.FromString(r) if r is not None else None for r in batch.results]
    ran = [r for r, state in zip(results, batch.job_states, strict=True) if state == JobState.DONE]
    answers = [r.completion for r in ran if r is not None and r.HasField("completion")]
    completed = len(answers)
    failed = len(ran) - completed + len(record.rejected)
    created = batch.created_at_ms // 1000
    reply = router_pb2.Batch(
        id=batch.batch_id,
        endpoint=record.endpoint,
        input_file_id=record.input_file_id,
        completion_window=record.completion_window,
        status=_STATUSES[batch.state],
        created_at=created,
        expires_at=created + COMPLETION_WINDOW_SECONDS,
        total=len(batch.results) + len(record.rejected),
        completed=completed,
        failed=failed,
        metadata=record.metadata,
        model=batch.model,
        usage=common_pb2.Usage(
            prompt_tokens=sum(a.usage.prompt_tokens for a in answers),
            cached_tokens=sum(a.usage.cached_tokens for a in answers),
            completion_tokens=sum(a.usage.completion_tokens for a in answers),
        ),
    )
    finished = (batch.finished_at_ms or 0) // 1000
    if not batch.results:
        # Every line was refused: nothing ran, the batch failed validation.
        reply.status = router_pb2.OPEN_AI_BATCH_STATUS_FAILED
        reply.failed_at = finished
        reply.errors.extend(
            router_pb2.BatchLineError(code=code, message=message, line=line)
            for _, code, message, line in record.rejected
        )
        return reply
    reply.in_progress_at = created
    if batch.expired_at_ms is not None:
        reply.finalizing_at = batch.expired_at_ms // 1000
        if batch.finished:
            reply.expired_at = finished
    elif batch.cancelled_at_ms is not None:
        reply.cancelling_at = batch.cancelled_at_ms // 1000
        reply.cancelled_at = finished
    elif batch.finished:
        reply.finalizing_at = reply.completed_at = finished
    if batch.finished:
        if completed:
            reply.output_file_id = _OUTPUT_PREFIX + batch.batch_id
        if completed < len(batch.results) or record.rejected:
            reply.error_file_id = _ERRORS_PREFIX + batch.batch_id
    return reply


def _output_lines(batch: BatchView, record: FileBatchRecord) -> list[router_pb2.BatchResultLine]:
    lines = []
    for position, (result, state) in enumerate(zip(batch.results, batch.job_states, strict=True)):
        outcome = router_pb2.QueuedResult.FromString(result) if result is not None else None
        if state == JobState.DONE and outcome is not None and outcome.HasField("completion"):
            lines.append(
                router_pb2.BatchResultLine(
                    custom_id=record.custom_ids[position],
                    request_id=f"{batch.batch_id}-{position}",
                    completion=outcome.completion,
                    endpoint=record.endpoint,
                )
            )
    return lines


def _error_lines(batch: BatchView, record: FileBatchRecord) -> list[router_pb2.BatchResultLine]:
    lines = [
        router_pb2.BatchResultLine(
            custom_id=custom_id,
            line_error=router_pb2.BatchLineError(code=code, message=message, line=line),
            endpoint=record.endpoint,
        )
        for custom_id, code, message, line in record.rejected
    ]
    for position, (result, state) in enumerate(zip(batch.results, batch.job_states, strict=True)):
        custom_id = record.custom_ids[position]
        if state == JobState.CANCELLED:
            expired = batch.expired_at_ms is not None
            lines.append(
                router_pb2.BatchResultLine(
                    custom_id=custom_id,
                    line_error=router_pb2.BatchLineError(
                        code="batch_expired" if expired else "batch_cancelled",
                        message=(
                            f"the batch's {COMPLETION_WINDOW} completion window ended before this request ran"
                            if expired
                            else "the batch was cancelled before this request ran"
                        ),
                    ),
                    endpoint=record.endpoint,
                )
            )
            continue
        outcome = router_pb2.QueuedResult.FromString(result) if result is not None else None
        if outcome is not None and outcome.HasField("error"):
            lines.append(
                router_pb2.BatchResultLine(
                    custom_id=custom_id,
                    request_id=f"{batch.batch_id}-{position}",
                    error=outcome.error,
                    endpoint=record.endpoint,
                )
            )
    return lines


def _file(stored: StoredFile) -> router_pb2.File:
    return router_pb2.File(
        id=stored.file_id,
        bytes=stored.size,
        created_at=stored.created_at_ms // 1000,
        filename=stored.filename,
        purpose=stored.purpose,
    )


def _no_file(file_id: str) -> NotFound:
    return NotFound(f"no file {file_id!r}", param="file_id")
