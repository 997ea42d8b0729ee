"""The async queue end to end: real tokenizer, usage, cache index, two tiny-model engines, router.

Each test uses its own account, so that the usage ledger's per-account totals
belong to that test alone and can be compared with the batch's results.
"""

from __future__ import annotations

import asyncio
import json
import signal
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from metrics_scrape import Figures, growth, scrape
from queued_batches import auth, batch_of, chat, check_completed, wait_done
from service_processes import ENGINE_SERVER_BUILT, TINY_MODEL_ID, CachetStack, ServiceProcess
from webhook_receiver import Receiver

from cachet.grpc_channel import create_channel
from cachet.models.tiny import write_tiny_model
from cachet.router.sqlite_queue_store import SqliteQueueStore
from cachet.router.v1 import router_pb2, router_pb2_grpc
from cachet.router.webhooks import SIGNATURE_HEADER, verify
from cachet.usage.v1 import usage_pb2, usage_pb2_grpc

SECRET = "queue-test-secret"
ACCOUNTS = {f"sk-{name}": f"acct-{name}" for name in ("drain", "kill", "hook", "other", "live")}
ROUTER_ENV = {
    "CACHET_ROUTER_API_KEYS": json.dumps(ACCOUNTS),
    "CACHET_ROUTER_WEBHOOK_SECRET": SECRET,
    "CACHET_ROUTER_WEBHOOK_FIRST_BACKOFF_SECONDS": "0.2",
    "CACHET_ROUTER_WEBHOOK_MAX_BACKOFF_SECONDS": "1.0",
    # The tests' receivers listen on loopback, which webhooks may reach only when allowed.
    "CACHET_ROUTER_WEBHOOK_ALLOWED_NETWORKS": '["127.0.0.1/32"]',
    # Short leases: jobs of a killed router are taken again within seconds.
    "CACHET_ROUTER_QUEUE_LEASE_SECONDS": "2",
}
DRAIN_REQUESTS = 200


@dataclass
class QueueStack:
    """The stack plus its (restartable) router."""

    stack: CachetStack
    data_dir: Path

    @property
    def router(self) -> ServiceProcess:
        return self.stack.processes["router"]

    def restart_router(self, signum: int) -> None:
        self.router.stop(signum)
        self.stack.processes["router"] = self.stack.start_router(**ROUTER_ENV)


@pytest.fixture(scope="module")
def queue_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[QueueStack]:
    if not ENGINE_SERVER_BUILT:
        pytest.skip("the engine server (cachet.engine.main) is not built yet")
    root = tmp_path_factory.mktemp("queue-e2e")
    stack = CachetStack(root, write_tiny_model(root / TINY_MODEL_ID)).start(router_env=ROUTER_ENV)
    running = QueueStack(stack, root / "router-data")
    try:
        yield running
    finally:
        stack.stop()
        print(stack.logs())


@pytest.fixture
async def inference(queue_stack: QueueStack) -> AsyncIterator[router_pb2_grpc.InferenceServiceStub]:
    async with create_channel(queue_stack.router.address) as channel:
        yield router_pb2_grpc.InferenceServiceStub(channel)


async def ledger_matches(
    queue_stack: QueueStack, account: str, batches: list[router_pb2.QueuedBatch]
) -> None:
    """The usage ledger holds exactly one record per queued request, with the results' token counts."""
    results = [result.completion for batch in batches for result in batch.results]
    expected = (
        len(results),
        sum(r.usage.prompt_tokens for r in results),
        sum(r.usage.completion_tokens for r in results),
    )
    async with create_channel(queue_stack.stack.address("usage")) as channel:
        usage = usage_pb2_grpc.UsageServiceStub(channel)
        deadline = time.monotonic() + 10
        while True:
            reply = await usage.QueryUsage(
                usage_pb2.QueryUsageRequest(account_id=f"acct-{account}"), timeout=10
            )
            rows = [(r.requests, r.prompt_tokens, r.completion_tokens) for r in reply.rows]
            if rows == [expected] or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.1)  # usage records land just after their results
    assert rows == [expected]


async def test_queued_requests_drain_while_interactive_traffic_flows(
    queue_stack: QueueStack, inference
) -> None:
    receiver = Receiver()
    before = await asyncio.to_thread(scrape, queue_stack.router.metrics_port, "cachet_router_queue_")
    try:
        queued = await inference.QueueRequests(
            batch_of(DRAIN_REQUESTS, webhook_url=receiver.url), metadata=auth("drain"), timeout=10
        )
        assert queued.status == router_pb2.BATCH_STATUS_QUEUED
        # Interactive requests keep being served (never refused) while the queue drains.
        interactive = []
        for _ in range(10):
            interactive.append(
                await inference.CreateChatCompletion(chat(), metadata=auth("live"), timeout=30)
            )
        assert all(c.usage.completion_tokens == 4 for c in interactive)
        batch = await wait_done(inference, queued.request_id, "drain", timeout=90)
        check_completed(batch, DRAIN_REQUESTS, 4)
        await ledger_matches(queue_stack, "drain", [batch])
        await queue_figures_match(queue_stack, before, DRAIN_REQUESTS)
        # The batch's end is announced once, signed with the shared secret.
        deadline = time.monotonic() + 10
        while not receiver.calls and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert len(receiver.calls) == 1
        _, headers, body = receiver.calls[0]
        assert verify(SECRET, headers[SIGNATURE_HEADER], body)
        assert not verify("wrong-secret", headers[SIGNATURE_HEADER], body)
        event = json.loads(body)
        assert event["type"] == "batch.finished" and event["request_id"] == queued.request_id
        assert (event["requests"], event["succeeded"], event["failed"]) == (DRAIN_REQUESTS, DRAIN_REQUESTS, 0)
    finally:
        receiver.close()


async def queue_figures_match(queue_stack: QueueStack, before: Figures, jobs: int) -> None:
    """The router's metrics saw ``jobs`` more results written, each started and none twice,
    and the store's backlog is empty again."""

    deadline = time.monotonic() + 10
    while True:
        # A result's figure is counted just after its commit, which the batch's status follows.
        after = await asyncio.to_thread(scrape, queue_stack.router.metrics_port, "cachet_router_queue_")
        grew = growth(before, after)
        if grew("cachet_router_queue_results_total", outcome="stored") == jobs:
            break
        assert time.monotonic() < deadline, after
        await asyncio.sleep(0.1)
    assert grew("cachet_router_queue_results_total", outcome="duplicate") == 0
    assert grew("cachet_router_queue_jobs_started_total") >= jobs
    assert grew("cachet_router_queue_completions_per_commit_sum") == jobs
    # Every job's life by stage; leases are shared, so at least one.
    for stage in ("start", "generate", "record"):
        assert grew("cachet_router_queue_job_stage_seconds_count", stage=stage) >= jobs, stage
    leases = grew("cachet_router_queue_job_stage_seconds_count", stage="lease")
    assert 1 <= leases <= grew("cachet_router_queue_jobs_started_total")
    assert grew("cachet_router_queue_jobs", state="done") == jobs
    assert after["cachet_router_queue_jobs", (("state", "queued"),)] == 0
    assert after["cachet_router_queue_jobs", (("state", "leased"),)] == 0


async def test_another_account_cannot_read_a_batch(inference) -> None:
    queued = await inference.QueueRequests(batch_of(1), metadata=auth("other"), timeout=10)
    with pytest.raises(grpc.aio.AioRpcError) as foreign:
        await inference.GetQueuedBatch(
            router_pb2.GetQueuedBatchRequest(request_id=queued.request_id), metadata=auth("live"), timeout=10
        )
    assert foreign.value.code() == grpc.StatusCode.NOT_FOUND
    await wait_done(inference, queued.request_id, "other", timeout=30)


async def test_a_webhook_that_fails_twice_is_delivered_on_the_third_try(
    queue_stack: QueueStack, inference
) -> None:
    receiver = Receiver(statuses=[503, 500])
    try:
        queued = await inference.QueueRequests(
            batch_of(2, webhook_url=receiver.url), metadata=auth("hook"), timeout=10
        )
        await wait_done(inference, queued.request_id, "hook", timeout=30)
        deadline = time.monotonic() + 15
        while len(receiver.calls) < 3 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.5)  # no fourth call after the success
        assert [status for status, _, _ in receiver.calls] == [503, 500, 200]
        assert all(verify(SECRET, headers[SIGNATURE_HEADER], body) for _, headers, body in receiver.calls)
        store = SqliteQueueStore(queue_stack.data_dir / "queue.sqlite3")
        try:
            attempts = await store.webhook_attempts(queued.request_id)
            view = await store.batch(queued.request_id, "acct-hook")
        finally:
            await store.close()
        assert [(a.attempt, a.http_status) for a in attempts] == [(1, 503), (2, 500), (3, 200)]
        assert view is not None and view.webhook_state == "delivered"
    finally:
        receiver.close()


async def test_a_router_killed_mid_drain_finishes_every_job_once_after_restart(
    queue_stack: QueueStack,
) -> None:
    # Staggered lengths: the jobs end one after another, so the kill lands mid-drain.
    count = 30
    max_tokens = [8 + 8 * i for i in range(count)]
    async with create_channel(queue_stack.router.address) as channel:
        inference = router_pb2_grpc.InferenceServiceStub(channel)
        queued = await inference.QueueRequests(batch_of(count, max_tokens), metadata=auth("kill"), timeout=10)
        store = SqliteQueueStore(queue_stack.data_dir / "queue.sqlite3")

        async def done() -> int:
            view = await store.batch(queued.request_id, "acct-kill")
            assert view is not None
            return sum(result is not None for result in view.results)

        try:
            deadline = time.monotonic() + 60
            while await done() < 3:
                assert time.monotonic() < deadline, "the drain never started"
                await asyncio.sleep(0.02)
            assert await done() < count, "drained before the kill: make the jobs longer"
        finally:
            await store.close()
    queue_stack.restart_router(signal.SIGKILL)
    async with create_channel(queue_stack.router.address) as channel:
        inference = router_pb2_grpc.InferenceServiceStub(channel)
        batch = await wait_done(inference, queued.request_id, "kill", timeout=90)
    check_completed(batch, count, max_tokens)
    await ledger_matches(queue_stack, "kill", [batch])
