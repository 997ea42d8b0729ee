"""QueueRequests, GetQueuedBatch, CancelQueuedBatch, ListWebhookAttempts: validate, store, answer.

The dispatcher does the running.

A batch is accepted whatever the load (the queue never answers "out of capacity")
once its requests are well formed, since a malformed one would only fail later.
The model must be served when any engine has reported; while none has (a cold
start), the batch is accepted and waits. A batch belongs to the account that
queued it: any other account is told it does not exist (NOT_FOUND, not
PERMISSION_DENIED, so batch ids cannot be probed).

A batch that names no webhook gets its account's default, if one is configured
(``CACHET_ROUTER_DEFAULT_WEBHOOKS``), fixed when the batch is stored. A webhook the
caller names is refused (INVALID_ARGUMENT) when it lands on an address webhooks may
not reach (webhook_targets.py); one whose host does not resolve right now is
accepted, and its deliveries are checked again.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping

from cachet.errors import CachetError, InvalidArgument, NotFound
from cachet.logs import get_logger
from cachet.router.caller import Caller
from cachet.router.prompt import validate_chat, validate_completion
from cachet.router.queue_store import BatchState, BatchView, QueueStore
from cachet.router.replica_set import ReplicaSet
from cachet.router.v1 import router_pb2
from cachet.router.webhook_targets import TargetUnresolved, WebhookTargets

log = get_logger(__name__)

# How long queueing a batch waits for its webhook's host to resolve before accepting it
# unchecked (every delivery is checked again).
_RESOLVE_TIMEOUT_SECONDS = 5.0

_STATUSES = {
    BatchState.QUEUED: router_pb2.BATCH_STATUS_QUEUED,
    BatchState.RUNNING: router_pb2.BATCH_STATUS_RUNNING,
    BatchState.DONE: router_pb2.BATCH_STATUS_DONE,
    BatchState.CANCELLING: router_pb2.BATCH_STATUS_CANCELLING,
    BatchState.CANCELLED: router_pb2.BATCH_STATUS_CANCELLED,
    # Only OpenAI batches expire; a Workers AI batch has no window.
    BatchState.EXPIRING: router_pb2.BATCH_STATUS_CANCELLING,
    BatchState.EXPIRED: router_pb2.BATCH_STATUS_CANCELLED,
}
# What a job of an OpenAI batch whose completion window ended before it ran answers.
EXPIRED_RESULT = router_pb2.QueuedResult(
    error=router_pb2.RequestError(
        code="EXPIRED", message="the batch's completion window ended before this request ran"
    )
)
# What a job cancelled before it ran answers.
CANCELLED_RESULT = router_pb2.QueuedResult(
    error=router_pb2.RequestError(code="CANCELLED", message="the batch was cancelled before this request ran")
)


class BatchQueue:
    def __init__(
        self,
        store: QueueStore,
        replicas: ReplicaSet,
        max_requests: int,
        default_webhooks: Mapping[str, str] | None = None,
        on_batch_finished: Callable[[str], None] = lambda batch_id: None,
        webhook_targets: WebhookTargets | None = None,
    ) -> None:
        self._store = store
        self._targets = webhook_targets or WebhookTargets()
        self._replicas = replicas
        self._max_requests = max_requests
        self._default_webhooks = dict(default_webhooks or {})
        # A cancel can finish a batch too; it tells the webhook sender as the dispatcher does.
        self._on_batch_finished = on_batch_finished

    async def submit(
        self, request: router_pb2.QueueRequestsRequest, caller: Caller
    ) -> router_pb2.QueuedBatch:
        self._validate(request)
        webhook = await self.webhook_for(caller, request.webhook_url)
        bodies = [_with_model(queued, request.model).SerializeToString() for queued in request.requests]
        batch_id = await self._store.create_batch(
            caller.account_id, request.model, bodies, webhook, api_key_id=caller.api_key_id
        )
        return router_pb2.QueuedBatch(request_id=batch_id, status=router_pb2.BATCH_STATUS_QUEUED)

    async def webhook_for(self, caller: Caller, requested: str) -> str:
        """The batch's own webhook URL once checked, else its account's default ('' for none)."""
        if not requested:
            return self._default_webhooks.get(caller.account_id, "")
        try:
            await asyncio.wait_for(self._targets.resolve(requested), _RESOLVE_TIMEOUT_SECONDS)
        except (TargetUnresolved, TimeoutError) as failure:
            # DNS may be down for a moment; each delivery resolves and checks the host again.
            log.info("webhook host unresolved at submission", error=str(failure) or "timeout")
        return requested

    async def get(self, request: router_pb2.GetQueuedBatchRequest, caller: Caller) -> router_pb2.QueuedBatch:
        batch = await self._store.batch(request.request_id, caller.account_id, results_once_finished=True)
        if batch is None:
            raise NotFound(f"no queued batch {request.request_id!r}", param="request_id")
        return _reply(batch)

    async def cancel(
        self, request: router_pb2.CancelQueuedBatchRequest, caller: Caller
    ) -> router_pb2.QueuedBatch:
        """Cancel; answers the batch as it stands after (cancelling while started jobs run, else cancelled)."""
        cancellation = await self._store.cancel_batch(
            request.request_id, caller.account_id, CANCELLED_RESULT.SerializeToString()
        )
        if cancellation is None:
            raise NotFound(f"no queued batch {request.request_id!r}", param="request_id")
        if cancellation.batch_finished:
            self._on_batch_finished(request.request_id)
        batch = await self._store.batch(request.request_id, caller.account_id)
        assert batch is not None  # it was there a moment ago, and batches are never deleted
        return _reply(batch)

    async def webhook_attempts(
        self, request: router_pb2.ListWebhookAttemptsRequest, caller: Caller
    ) -> router_pb2.ListWebhookAttemptsResponse:
        batch = await self._store.batch(request.request_id, caller.account_id)
        if batch is None:
            raise NotFound(f"no queued batch {request.request_id!r}", param="request_id")
        attempts = await self._store.webhook_attempts(batch.batch_id)
        return router_pb2.ListWebhookAttemptsResponse(
            webhook_url=batch.webhook_url,
            state=batch.webhook_state,
            attempts=[
                router_pb2.WebhookAttempt(
                    attempt=a.attempt, at_ms=a.at_ms, http_status=a.http_status, error=a.error
                )
                for a in attempts
            ],
        )

    def check_model_served(self, model: str) -> None:
        """NOT_FOUND for a model no engine serves (accepted while no engine has reported yet)."""
        served = any(self._replicas.get(a).info for a in self._replicas.addresses)
        if served and self._replicas.engine_info(model) is None:
            raise NotFound(f"model {model!r} is not served here; see ListModels", param="model")

    def _validate(self, request: router_pb2.QueueRequestsRequest) -> None:
        if not request.model:
            raise InvalidArgument("model is required", param="model")
        if not 1 <= len(request.requests) <= self._max_requests:
            raise InvalidArgument(f"a batch holds 1 to {self._max_requests} requests", param="requests")
        self.check_model_served(request.model)
        for index, queued in enumerate(request.requests):
            validate_one(f"requests[{index}]", queued, request.model)


def _with_model(queued: router_pb2.QueuedRequest, model: str) -> router_pb2.QueuedRequest:
    """The request with the batch's model (a request naming another model is refused)."""
    copy = router_pb2.QueuedRequest()
    copy.CopyFrom(queued)
    kind = copy.WhichOneof("body")
    if kind is not None:
        body = getattr(copy, kind)
        body.model = body.model or model
    return copy


def validate_one(where: str, queued: router_pb2.QueuedRequest, model: str) -> None:
    """InvalidArgument naming ``where`` (e.g. ``requests[3]``) unless ``queued`` may be queued for ``model``."""
    kind = queued.WhichOneof("body")
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


def _reply(batch: BatchView) -> router_pb2.QueuedBatch:
    reply = router_pb2.QueuedBatch(request_id=batch.batch_id, status=_STATUSES[batch.state])
    if batch.finished:
        # Every job has ended (ran, failed or was cancelled), so every result is there.
        reply.results.extend(router_pb2.QueuedResult.FromString(r) for r in batch.results if r is not None)
    return reply
