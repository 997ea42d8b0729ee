"""OpenAI batch JSON <-> router protos: input lines in, batches and output/error files out.

An input file is parsed here, line by line, with the same request models the
synchronous endpoints use, so a line is refused for exactly what the endpoint
would refuse. A bad line does not fail the upload or the batch: it travels to the
router as a rejection (line number, custom_id, why) and comes back in the error
file; the rest runs.
"""

from __future__ import annotations

import json
from typing import Any

import grpc
import pydantic

from cachet.bridge import convert, schemas
from cachet.bridge.batch_schemas import BatchInputLine
from cachet.bridge.errors import STATUS_TABLE, field_path
from cachet.router.v1 import router_pb2

Json = dict[str, Any]

_STATUSES = {
    router_pb2.OPEN_AI_BATCH_STATUS_UNSPECIFIED: "validating",
    router_pb2.OPEN_AI_BATCH_STATUS_VALIDATING: "validating",
    router_pb2.OPEN_AI_BATCH_STATUS_FAILED: "failed",
    router_pb2.OPEN_AI_BATCH_STATUS_IN_PROGRESS: "in_progress",
    router_pb2.OPEN_AI_BATCH_STATUS_FINALIZING: "finalizing",
    router_pb2.OPEN_AI_BATCH_STATUS_COMPLETED: "completed",
    router_pb2.OPEN_AI_BATCH_STATUS_EXPIRED: "expired",
    router_pb2.OPEN_AI_BATCH_STATUS_CANCELLING: "cancelling",
    router_pb2.OPEN_AI_BATCH_STATUS_CANCELLED: "cancelled",
}
_REQUEST_MODELS: dict[str, tuple[type[pydantic.BaseModel], Any, str]] = {
    "/v1/chat/completions": (schemas.ChatCompletionBody, convert.chat_request_to_proto, "chat"),
    "/v1/completions": (schemas.CompletionBody, convert.completion_request_to_proto, "completion"),
}
_INVALID = "invalid_request"


class LineRefused(Exception):
    """Why one input line cannot run."""


def parse_input_file(
    content: bytes, endpoint: str
) -> tuple[list[router_pb2.BatchLine], list[router_pb2.BatchLineRejection]]:
    """The runnable lines and the refused ones of a JSON-lines input file (blank lines skipped)."""
    lines: list[router_pb2.BatchLine] = []
    rejected: list[router_pb2.BatchLineRejection] = []
    for number, raw in enumerate(content.splitlines(), start=1):
        if not raw.strip():
            continue
        custom_id = ""
        try:
            parsed = _json_line(raw)
            named = parsed.get("custom_id")
            custom_id = named if isinstance(named, str) else ""
            lines.append(_batch_line(parsed, endpoint, number))
        except LineRefused as refusal:
            error = router_pb2.BatchLineError(code=_INVALID, message=f"line {number}: {refusal}", line=number)
            rejected.append(router_pb2.BatchLineRejection(custom_id=custom_id, error=error))
    return lines, rejected


def _json_line(raw: bytes) -> Json:
    try:
        parsed = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise LineRefused("not valid JSON") from None
    if not isinstance(parsed, dict):
        raise LineRefused("a line must be a JSON object")
    return parsed


def _batch_line(parsed: Json, endpoint: str, number: int) -> router_pb2.BatchLine:
    line = _validated(BatchInputLine, parsed)
    if line.url != endpoint:
        raise LineRefused(f"url is {line.url!r} but the batch's endpoint is {endpoint!r}")
    model, to_proto, kind = _REQUEST_MODELS[line.url]
    body = _validated(model, line.body, prefix="body.")
    if getattr(body, "stream", False):
        raise LineRefused("body.stream is not supported in a batch")
    request = router_pb2.QueuedRequest(**{kind: to_proto(body)})
    return router_pb2.BatchLine(custom_id=line.custom_id, line=number, request=request)


def _validated(model: type[pydantic.BaseModel], data: Json, prefix: str = "") -> Any:
    try:
        return model.model_validate(data)
    except pydantic.ValidationError as error:
        first = error.errors()[0]
        where = field_path(first.get("loc", ()), data, first.get("type") == "missing") or ""
        raise LineRefused(f"{prefix}{where}: {first.get('msg', 'invalid')}".strip(": ")) from None


# ================================================================ proto -> JSON


def file_to_json(file: router_pb2.File, size: int | None = None) -> Json:
    return {
        "id": file.id,
        "object": "file",
        "bytes": file.bytes if size is None else size,
        "created_at": file.created_at,
        "filename": file.filename,
        "purpose": file.purpose,
        "status": "processed",
    }


def batch_to_json(batch: router_pb2.Batch) -> Json:
    usage = batch.usage
    return {
        "id": batch.id,
        "object": "batch",
        "endpoint": batch.endpoint,
        "model": batch.model or None,
        "errors": {"object": "list", "data": [_line_error(e) for e in batch.errors]}
        if batch.errors
        else None,
        "input_file_id": batch.input_file_id,
        "completion_window": batch.completion_window,
        "status": _STATUSES[batch.status],
        "output_file_id": batch.output_file_id or None,
        "error_file_id": batch.error_file_id or None,
        "created_at": batch.created_at,
        "in_progress_at": batch.in_progress_at or None,
        "expires_at": batch.expires_at or None,
        "finalizing_at": batch.finalizing_at or None,
        "completed_at": batch.completed_at or None,
        "failed_at": batch.failed_at or None,
        "expired_at": batch.expired_at or None,
        "cancelling_at": batch.cancelling_at or None,
        "cancelled_at": batch.cancelled_at or None,
        "request_counts": {"total": batch.total, "completed": batch.completed, "failed": batch.failed},
        "usage": {
            "input_tokens": usage.prompt_tokens,
            "input_tokens_details": {"cached_tokens": usage.cached_tokens},
            "output_tokens": usage.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        },
        "metadata": dict(batch.metadata) or None,
    }


def batch_list_to_json(response: router_pb2.ListBatchesResponse) -> Json:
    data = [batch_to_json(batch) for batch in response.batches]
    return {
        "object": "list",
        "data": data,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
        "has_more": response.has_more,
    }


def webhook_attempts_to_json(response: router_pb2.ListWebhookAttemptsResponse) -> Json:
    return {
        "object": "list",
        "webhook_url": response.webhook_url or None,
        "state": response.state or None,
        "data": [
            {
                "object": "webhook_attempt",
                "attempt": attempt.attempt,
                "at": attempt.at_ms,
                "http_status": attempt.http_status or None,
                "error": attempt.error or None,
            }
            for attempt in response.attempts
        ],
    }


def results_to_jsonl(results: router_pb2.BatchResults) -> bytes:
    """An output or error file: one JSON object per line, in OpenAI's batch output shape."""
    return b"".join(
        json.dumps(_result_line(results.batch_id, line), separators=(",", ":")).encode() + b"\n"
        for line in results.lines
    )


def _result_line(batch_id: str, line: router_pb2.BatchResultLine) -> Json:
    outcome = line.WhichOneof("outcome")
    # A line that never ran has no request id: a refused one is named by its line number
    # (it may lack a custom_id), a cancelled one by its custom_id (unique among good lines).
    never_ran = f"{batch_id}-{line.line_error.line or line.custom_id}"
    line_id = f"batch_req_{line.request_id or never_ran}"
    if outcome == "line_error":
        return {
            "id": line_id,
            "custom_id": line.custom_id,
            "response": None,
            "error": _line_error(line.line_error),
        }
    if outcome == "completion":
        render = (
            convert.chat_completion_to_json
            if line.endpoint == "/v1/chat/completions"
            else convert.text_completion_to_json
        )
        status, body = 200, render(line.completion)
    else:
        status, body = _failure(line.error)
    response = {"status_code": status, "request_id": line.request_id, "body": body}
    return {"id": line_id, "custom_id": line.custom_id, "response": response, "error": None}


def _failure(error: router_pb2.RequestError) -> tuple[int, Json]:
    """A request that ran and failed, as the endpoint would have answered it (status and error body)."""
    code = grpc.StatusCode.__members__.get(error.code, grpc.StatusCode.UNKNOWN)
    status, error_type = STATUS_TABLE.get(code, (500, "server_error"))
    return status, {"error": {"message": error.message, "type": error_type, "param": None, "code": None}}


def _line_error(error: router_pb2.BatchLineError) -> Json:
    return {"code": error.code, "message": error.message, "param": None, "line": error.line or None}
