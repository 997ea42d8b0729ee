"""InferenceService: proto in, pipeline, proto out. No logic of its own.

The serving replica of a stream goes out in the initial metadata
(``x-cachet-replica``), since chunks have no field for it; whole completions
carry it in ``replica_address``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc

from cachet.errors import RATE_LIMITS_METADATA_KEY
from cachet.router.batch_queue import BatchQueue
from cachet.router.caller import AccountDirectory, Caller
from cachet.router.choices import ChoiceGroup
from cachet.router.file_batches import FileBatches
from cachet.router.key_limits import KeyLimiter
from cachet.router.replica_status import ReplicaStatusReader
from cachet.router.request_pipeline import Generation, RequestPipeline
from cachet.router.stored_responses import StoredResponses
from cachet.router.v1 import router_pb2, router_pb2_grpc

SERVICE_NAME = router_pb2.DESCRIPTOR.services_by_name["InferenceService"].full_name
REPLICA_METADATA_KEY = "x-cachet-replica"


class InferenceServicer(router_pb2_grpc.InferenceServiceServicer):
    def __init__(
        self,
        pipeline: RequestPipeline,
        accounts: AccountDirectory,
        queue: BatchQueue,
        file_batches: FileBatches,
        responses: StoredResponses,
        limits: KeyLimiter | None = None,
        *,
        replica_status: ReplicaStatusReader,
    ) -> None:
        self._pipeline = pipeline
        self._replica_status = replica_status
        self._accounts = accounts
        self._queue = queue
        self._file_batches = file_batches
        self._limits = limits
        self._responses = responses

    async def CreateChatCompletion(self, request, context) -> router_pb2.ChatCompletion:  # noqa: N802
        caller, limits = await self._admitted(context, request.session_id)
        generation = await self._pipeline.start_chat(request, caller, stream=False)
        if limits:
            await context.send_initial_metadata(limits)
        return await _owned(generation, context).collect()

    async def StreamChatCompletion(self, request, context) -> AsyncIterator[router_pb2.ChatCompletionChunk]:  # noqa: N802
        caller, limits = await self._admitted(context, request.session_id)
        generation = _owned(await self._pipeline.start_chat(request, caller), context)
        await context.send_initial_metadata(((REPLICA_METADATA_KEY, generation.replica_address), *limits))
        async for chunk in generation.chunks():
            yield chunk

    async def CreateCompletion(self, request, context) -> router_pb2.ChatCompletion:  # noqa: N802
        caller, limits = await self._admitted(context, request.session_id)
        generation = await self._pipeline.start_completion(request, caller, stream=False)
        if limits:
            await context.send_initial_metadata(limits)
        return await _owned(generation, context).collect()

    async def StreamCompletion(self, request, context) -> AsyncIterator[router_pb2.ChatCompletionChunk]:  # noqa: N802
        caller, limits = await self._admitted(context, request.session_id)
        generation = _owned(await self._pipeline.start_completion(request, caller), context)
        await context.send_initial_metadata(((REPLICA_METADATA_KEY, generation.replica_address), *limits))
        async for chunk in generation.chunks():
            yield chunk

    async def ListModels(self, request, context) -> router_pb2.ListModelsResponse:  # noqa: N802
        return router_pb2.ListModelsResponse(models=self._pipeline.list_models())

    async def QueueRequests(self, request, context) -> router_pb2.QueuedBatch:  # noqa: N802
        return await self._queue.submit(request, await self._caller(context))

    async def GetQueuedBatch(self, request, context) -> router_pb2.QueuedBatch:  # noqa: N802
        return await self._queue.get(request, await self._caller(context))

    async def CancelQueuedBatch(self, request, context) -> router_pb2.QueuedBatch:  # noqa: N802
        return await self._queue.cancel(request, await self._caller(context))

    async def ListWebhookAttempts(self, request, context) -> router_pb2.ListWebhookAttemptsResponse:  # noqa: N802
        return await self._queue.webhook_attempts(request, await self._caller(context))

    async def UploadFile(self, request, context) -> router_pb2.File:  # noqa: N802
        return await self._file_batches.upload(request, await self._caller(context))

    async def GetFile(self, request, context) -> router_pb2.File:  # noqa: N802
        return await self._file_batches.get_file(request, await self._caller(context))

    async def GetFileContent(self, request, context) -> router_pb2.FileContent:  # noqa: N802
        return await self._file_batches.get_file_content(request, await self._caller(context))

    async def CreateBatch(self, request, context) -> router_pb2.Batch:  # noqa: N802
        return await self._file_batches.create(request, await self._caller(context))

    async def GetBatch(self, request, context) -> router_pb2.Batch:  # noqa: N802
        return await self._file_batches.get(request, await self._caller(context))

    async def CancelBatch(self, request, context) -> router_pb2.Batch:  # noqa: N802
        return await self._file_batches.cancel(request, await self._caller(context))

    async def ListBatches(self, request, context) -> router_pb2.ListBatchesResponse:  # noqa: N802
        return await self._file_batches.list(request, await self._caller(context))

    async def PutStoredResponse(self, request, context) -> router_pb2.StoredResponseRef:  # noqa: N802
        return await self._responses.put(request, await self._caller(context))

    async def GetStoredResponse(self, request, context) -> router_pb2.StoredResponse:  # noqa: N802
        return await self._responses.get(request, await self._caller(context))

    async def DeleteStoredResponse(self, request, context) -> router_pb2.StoredResponseRef:  # noqa: N802
        return await self._responses.delete(request, await self._caller(context))

    async def ListStoredResponseItems(self, request, context) -> router_pb2.StoredResponseItems:  # noqa: N802
        return await self._responses.items(request, await self._caller(context))

    async def Authenticate(self, request, context) -> router_pb2.CallerIdentity:  # noqa: N802
        caller = await self._caller(context)
        return router_pb2.CallerIdentity(account_id=caller.account_id, api_key_id=caller.api_key_id)

    async def ListReplicaStatus(self, request, context) -> router_pb2.ReplicaStatusList:  # noqa: N802
        return await self._replica_status.read(await self._caller(context))

    async def _caller(self, context: grpc.aio.ServicerContext, session_id: str = "") -> Caller:
        return await self._accounts.caller(context.invocation_metadata(), session_id)

    async def _admitted(
        self, context: grpc.aio.ServicerContext, session_id: str
    ) -> tuple[Caller, tuple[tuple[str, bytes], ...]]:
        """The caller, admitted under its key's limits, and the initial metadata that tells it
        what is left of them (OpenAI sends its x-ratelimit-* headers on every answer)."""
        # Only calls that generate count against a key's limits; queueing is free, and the
        # queued jobs count when they run (the dispatcher admits each).
        caller = await self._caller(context, session_id)
        limits = await self._limits.admit(caller) if self._limits is not None else None
        return caller, ((RATE_LIMITS_METADATA_KEY, limits.SerializeToString()),) if limits else ()


def _owned(
    generation: Generation | ChoiceGroup, context: grpc.aio.ServicerContext
) -> Generation | ChoiceGroup:
    # Whatever way the call ends (finished, failed, client gone while we were idle),
    # the generation is closed: the engine request aborted if still running, usage recorded.
    # types-grpcio declares the callback type a class, not a Protocol, so no function matches it.
    context.add_done_callback(lambda _context: generation.close())  # type: ignore[arg-type]
    return generation
