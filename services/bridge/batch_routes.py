"""OpenAI Files and Batch API routes: each REST call -> router RPCs -> OpenAI JSON.

Files and batches live in the router's store; the bridge only translates. Creating
a batch reads the input file back from the router and parses its lines here
(``batch_convert``), so the router receives typed requests, never OpenAI JSON.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Form, Query, Request, UploadFile
from fastapi.responses import JSONResponse, Response

from cachet.bridge import batch_convert
from cachet.bridge.app import BackendsDep, CallerDep, _unary
from cachet.bridge.auth import Caller
from cachet.bridge.batch_schemas import (
    BatchCreateBody,
    BatchList,
    BatchObject,
    FileObject,
    WebhookAttemptList,
)
from cachet.bridge.errors import ERROR_RESPONSES, BridgeError
from cachet.router.v1 import router_pb2

api = APIRouter(responses=ERROR_RESPONSES)

_JSONL = "application/octet-stream"


@api.post("/v1/files", response_model=FileObject)
async def upload_file(
    request: Request,
    caller: CallerDep,
    backends: BackendsDep,
    file: UploadFile,
    purpose: Annotated[str, Form(description='Only "batch": JSON lines, one request each.')],
) -> Response:
    """Upload a batch input file (multipart form: ``file`` and ``purpose``)."""
    upload = router_pb2.UploadFileRequest(
        filename=file.filename or "input.jsonl", purpose=purpose, content=await file.read()
    )
    stored = await _unary(request, backends.inference.UploadFile, upload, caller)
    return JSONResponse(batch_convert.file_to_json(stored))


@api.get("/v1/files/{file_id}", response_model=FileObject)
async def get_file(file_id: str, request: Request, caller: CallerDep, backends: BackendsDep) -> Response:
    """A file's description: an uploaded input file, or a batch's output or error file."""
    file = await _unary(
        request, backends.inference.GetFile, router_pb2.GetFileRequest(file_id=file_id), caller
    )
    size = None
    if file.purpose == "batch_output":
        # Output files are rendered on read, so their size is that of the rendering.
        size = len(await _file_content(request, backends, caller, file_id))
    return JSONResponse(batch_convert.file_to_json(file, size))


@api.get("/v1/files/{file_id}/content", response_class=Response, responses={200: {"content": {_JSONL: {}}}})
async def get_file_content(
    file_id: str, request: Request, caller: CallerDep, backends: BackendsDep
) -> Response:
    """A file's bytes; a batch's output and error files are JSON lines in OpenAI's batch output shape."""
    return Response(await _file_content(request, backends, caller, file_id), media_type=_JSONL)


async def _file_content(request: Request, backends, caller: Caller, file_id: str) -> bytes:
    message = router_pb2.GetFileRequest(file_id=file_id)
    content = await _unary(request, backends.inference.GetFileContent, message, caller)
    if content.WhichOneof("content") == "batch_results":
        return batch_convert.results_to_jsonl(content.batch_results)
    return content.data


@api.post("/v1/batches", response_model=BatchObject)
async def create_batch(
    body: BatchCreateBody, request: Request, caller: CallerDep, backends: BackendsDep
) -> Response:
    """Queue every line of an uploaded input file; bad lines go to the error file, the rest runs."""
    content = await _file_content(request, backends, caller, body.input_file_id)
    lines, rejected = batch_convert.parse_input_file(content, body.endpoint)
    message = router_pb2.CreateBatchRequest(
        input_file_id=body.input_file_id,
        endpoint=body.endpoint,
        completion_window=body.completion_window,
        metadata=body.metadata or {},
        lines=lines,
        rejected=rejected,
        webhook_url=body.webhook_url or "",
    )
    batch = await _unary(request, backends.inference.CreateBatch, message, caller)
    return JSONResponse(batch_convert.batch_to_json(batch))


@api.get("/v1/batches/{batch_id}", response_model=BatchObject)
async def get_batch(batch_id: str, request: Request, caller: CallerDep, backends: BackendsDep) -> Response:
    """A batch: status, counts, usage and, once ended, its output and error file ids."""
    message = router_pb2.GetBatchRequest(batch_id=batch_id)
    return JSONResponse(
        batch_convert.batch_to_json(await _unary(request, backends.inference.GetBatch, message, caller))
    )


@api.post("/v1/batches/{batch_id}/cancel", response_model=BatchObject)
async def cancel_batch(batch_id: str, request: Request, caller: CallerDep, backends: BackendsDep) -> Response:
    """Cancel: lines not started never run; the batch is ``cancelling`` until started ones end."""
    message = router_pb2.GetBatchRequest(batch_id=batch_id)
    batch = await _unary(request, backends.inference.CancelBatch, message, caller)
    return JSONResponse(batch_convert.batch_to_json(batch))


@api.get("/v1/batches/{batch_id}/webhook_attempts", response_model=WebhookAttemptList)
async def list_webhook_attempts(
    batch_id: str, request: Request, caller: CallerDep, backends: BackendsDep
) -> Response:
    """Every call of the batch's webhook so far, oldest first (a Cachet extension). Any queued
    batch id works: an OpenAI batch's, or a Workers AI ``queueRequest`` request id."""
    message = router_pb2.ListWebhookAttemptsRequest(request_id=batch_id)
    response = await _unary(request, backends.inference.ListWebhookAttempts, message, caller)
    return JSONResponse(batch_convert.webhook_attempts_to_json(response))


@api.get("/v1/batches", response_model=BatchList)
async def list_batches(
    request: Request,
    caller: CallerDep,
    backends: BackendsDep,
    after: Annotated[str, Query(description="A batch id: list the batches older than it.")] = "",
    limit: Annotated[int, Query(description="Page size, 1 to 100.")] = 20,
) -> Response:
    """The caller's batches, newest first."""
    if not 1 <= limit <= 100:
        raise BridgeError(400, "limit must be between 1 and 100.", param="limit")
    message = router_pb2.ListBatchesRequest(after=after, limit=limit)
    response = await _unary(request, backends.inference.ListBatches, message, caller)
    return JSONResponse(batch_convert.batch_list_to_json(response))
