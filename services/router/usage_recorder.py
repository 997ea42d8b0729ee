"""Recording each request's usage exactly once, even when its client is gone.

The ledger is idempotent by request id, so retrying a record is always safe; the
record is sent from a task of its own so that a cancelled client call (which
cancels its handler) cannot cancel its billing. ``drain`` lets shutdown wait for
records still in flight.
"""

from __future__ import annotations

import asyncio

import grpc

from cachet.logs import get_logger
from cachet.usage.v1 import usage_pb2, usage_pb2_grpc

log = get_logger(__name__)

_ATTEMPTS = 5
_FIRST_BACKOFF_SECONDS = 0.2


class UsageRecorder:
    def __init__(self, stub: usage_pb2_grpc.UsageServiceStub, timeout_seconds: float) -> None:
        self._stub = stub
        self._timeout = timeout_seconds
        # Strong references: the event loop keeps only weak ones to tasks.
        self._pending: set[asyncio.Task[None]] = set()

    def submit(self, record: usage_pb2.UsageRecord) -> asyncio.Task[None]:
        task = asyncio.create_task(self._record(record))
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)
        return task

    async def drain(self, timeout: float) -> None:
        if self._pending:
            await asyncio.wait(set(self._pending), timeout=timeout)

    async def _record(self, record: usage_pb2.UsageRecord) -> None:
        backoff = _FIRST_BACKOFF_SECONDS
        for attempt in range(1, _ATTEMPTS + 1):
            try:
                await self._stub.RecordUsage(
                    usage_pb2.RecordUsageRequest(record=record), timeout=self._timeout
                )
                return
            except grpc.aio.AioRpcError as error:
                retryable = error.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
                if not retryable or attempt == _ATTEMPTS:
                    # Nothing more this process can do; the log line is the trail to reconcile from.
                    log.error(
                        "usage not recorded",
                        request_id=record.request_id,
                        code=error.code().name,
                        record=str(record).replace("\n", " "),
                    )
                    return
            await asyncio.sleep(backoff)
            backoff *= 2
