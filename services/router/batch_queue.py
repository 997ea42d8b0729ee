"""QueueRequests and GetQueuedBatch: validate, store, answer; the dispatcher does the running.

A batch is accepted whatever the load (the queue never answers "out of capacity")
once its requests are well formed, since a malformed one would only fail later.
The model must be served when any engine has reported; while none has (a cold
start), the batch is accepted and waits. A batch belongs to the account that
queued it: any other account is told it does not exist (NOT_FOUND, not
PERMISSION_DENIED, so batch ids cannot be probed).
"""

from __future__ import annotations

from urllib.parse import urlsplit

from cachet.errors import CachetError, InvalidArgument, NotFound
from cachet.router.caller import Caller
from cachet.router.prompt import validate_chat, validate_completion
from cachet.router.queue_store import BatchState, QueueStore
from cachet.router.replica_set import ReplicaSet
from cachet.router.v1 import router_pb2

_STATUSES = {
    BatchState.QUEUED: router_pb2.BATCH_STATUS_QUEUED,
    BatchState.RUNNING: router_pb2.BATCH_STATUS_RUNNING,
    BatchState.DONE: router_pb2.BATCH_STATUS_DONE,
}


class BatchQueue:
    def __init__(self, store: QueueStore, replicas: ReplicaSet, max_requests: int) -> None:
        self._store = store
        self._replicas = replicas
        self._max_requests = max_requests

    async def submit(
        self, request: router_pb2.QueueRequestsRequest, caller: Caller
    ) -> router_pb2.QueuedBatch:
        self._validate(request)
        bodies = [_with_model(queued, request.model).SerializeToString() for queued in request.requests]
        batch_id = await self._store.create_batch(
            caller.account_id, request.model, bodies, request.webhook_url
        )
        return router_pb2.QueuedBatch(request_id=batch_id, status=router_pb2.BATCH_STATUS_QUEUED)

    async def get(self, request: router_pb2.GetQueuedBatchRequest, caller: Caller) -> router_pb2.QueuedBatch:
        batch = await self._store.batch(request.request_id, caller.account_id)
        if batch is None:
            raise NotFound(f"no queued batch {request.request_id!r}", param="request_id")
        reply = router_pb2.QueuedBatch(request_id=batch.batch_id, status=_STATUSES[batch.state])
        if batch.state is BatchState.DONE:
            # Every job is done, so every result is there.
            reply.results.extend(
                router_pb2.QueuedResult.FromString(r) for r in batch.results if r is not None
            )
        return reply

    def _validate(self, request: router_pb2.QueueRequestsRequest) -> None:
        if not request.model:
            raise InvalidArgument("model is required", param="model")
        if not 1 <= len(request.requests) <= self._max_requests:
            raise InvalidArgument(f"a batch holds 1 to {self._max_requests} requests", param="requests")
        if request.webhook_url and urlsplit(request.webhook_url).scheme not in ("http", "https"):
            raise InvalidArgument("webhook_url must be an http(s) URL", param="webhook_url")
        served = any(self._replicas.get(a).info for a in self._replicas.addresses)
        if served and self._replicas.engine_info(request.model) is None:
            raise NotFound(f"model {request.model!r} is not served here; see ListModels", param="model")
        for index, queued in enumerate(request.requests):
            _validate_one(index, queued, request.model)


def _with_model(queued: router_pb2.QueuedRequest, model: str) -> router_pb2.QueuedRequest:
    """The request with the batch's model (a request naming another model is refused)."""
    copy = router_pb2.QueuedRequest()
    copy.CopyFrom(queued)
    kind = copy.WhichOneof("body")
    if kind is not None:
        body = getattr(copy, kind)
        body.model = body.model or model
    return copy


def _validate_one(index: int, queued: router_pb2.QueuedRequest, model: str) -> None:
    kind = queued.WhichOneof("body")
    where = f"requests[{index}]"
    if kind is None:
        raise InvalidArgument(f"{where} has no chat or completion body", param=where)
    body = getattr(_with_model(queued, model), kind)
    try:
        if body.model != model:
            raise InvalidArgument("every request of a batch uses the batch's model", param="model")
        if body.request_id:
            # Ids of queued requests are the queue's (the job id), so that a retried job is billed once.
            raise InvalidArgument("request_id is assigned by the queue", param="request_id")
        (validate_chat if kind == "chat" else validate_completion)(body)
    except CachetError as error:
        raise InvalidArgument(
            f"{where}: {error.message}", param=f"{where}.{error.param}".rstrip(".")
        ) from error
