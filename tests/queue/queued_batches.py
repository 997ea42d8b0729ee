"""Queued batches of tiny chat requests, as the end-to-end queue tests send and await them."""

from __future__ import annotations

import asyncio
import time
import uuid

from service_processes import TINY_MODEL_ID

from cachet.common.v1 import common_pb2
from cachet.router.v1 import router_pb2


def auth(account: str) -> tuple[tuple[str, str]]:
    return (("authorization", f"Bearer sk-{account}"),)


def chat(max_tokens: int = 4) -> router_pb2.ChatCompletionRequest:
    nonce = uuid.uuid4().hex
    message = common_pb2.ChatMessage(role="user", content=[common_pb2.ContentPart(text=f"[{nonce}] Hi")])
    sampling = common_pb2.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return router_pb2.ChatCompletionRequest(model=TINY_MODEL_ID, messages=[message], sampling=sampling)


def batch_of(
    count: int, max_tokens: int | list[int] = 4, webhook_url: str = ""
) -> router_pb2.QueueRequestsRequest:
    lengths = max_tokens if isinstance(max_tokens, list) else [max_tokens] * count
    return router_pb2.QueueRequestsRequest(
        model=TINY_MODEL_ID,
        requests=[router_pb2.QueuedRequest(chat=chat(length)) for length in lengths],
        webhook_url=webhook_url,
    )


async def wait_done(inference, batch_id: str, account: str, timeout: float) -> router_pb2.QueuedBatch:
    deadline = time.monotonic() + timeout
    while True:
        batch = await inference.GetQueuedBatch(
            router_pb2.GetQueuedBatchRequest(request_id=batch_id), metadata=auth(account), timeout=10
        )
        if batch.status == router_pb2.BATCH_STATUS_DONE:
            return batch
        assert time.monotonic() < deadline, f"batch {batch_id} still {batch.status} after {timeout} s"
        await asyncio.sleep(0.1)


def check_completed(batch: router_pb2.QueuedBatch, count: int, max_tokens: int | list[int]) -> None:
    lengths = max_tokens if isinstance(max_tokens, list) else [max_tokens] * count
    assert len(batch.results) == count
    ids = [result.completion.id for result in batch.results]
    # In request order, each under its job id (the ledger key).
    assert ids == [f"{batch.request_id}-{i}" for i in range(count)]
    for result, length in zip(batch.results, lengths, strict=True):
        assert result.WhichOneof("outcome") == "completion", result
        assert result.completion.usage.completion_tokens == length
        assert result.completion.usage.prompt_tokens > 0
