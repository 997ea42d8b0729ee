"""Two real router processes sharing one PostgreSQL queue store (and a usage service on the same
database): whichever router has headroom pulls a job, no job is leased twice, either router killed
-9 mid-drain of 10,000 jobs (each in turn, restarted) loses nothing, and the ledger holds each job once."""

from __future__ import annotations

import asyncio
import json
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass

import asyncpg
import pytest
from metrics_scrape import growth, scrape
from postgres_schemas import SessionSchemas
from queued_batches import auth, batch_of, check_completed, wait_done
from service_processes import ENGINE_SERVER_BUILT, TINY_MODEL_ID, CachetStack, ServiceProcess

from cachet.grpc_channel import create_channel
from cachet.models.tiny import write_tiny_model
from cachet.router.v1 import router_pb2_grpc
from cachet.usage.v1 import usage_pb2, usage_pb2_grpc

ACCOUNTS = {f"sk-{name}": f"acct-{name}" for name in ("shared", "kill")}


@dataclass
class TwoRouters:
    stack: CachetStack
    store_url: str
    router_env: dict[str, str]

    @property
    def routers(self) -> list[ServiceProcess]:
        return [self.stack.processes["router"], self.stack.processes["router-b"]]

    async def job_attempts(self, batch_ids: list[str]) -> list[int]:
        """Leases each job of these batches took, read from the database itself."""
        connection = await asyncpg.connect(self.store_url)
        try:
            rows = await connection.fetch(
                "SELECT attempts FROM jobs WHERE batch_id = ANY($1::text[]) AND state = 'done'", batch_ids
            )
        finally:
            await connection.close()
        return [row[0] for row in rows]

    async def done_jobs(self, batch_ids: list[str]) -> int:
        connection = await asyncpg.connect(self.store_url)
        try:
            return await connection.fetchval(
                "SELECT COUNT(*) FROM jobs WHERE batch_id = ANY($1::text[]) AND state = 'done'", batch_ids
            )
        finally:
            await connection.close()

    async def ledger_requests(self, account: str) -> int:
        async with create_channel(self.stack.address("usage")) as channel:
            usage = usage_pb2_grpc.UsageServiceStub(channel)
            reply = await usage.QueryUsage(usage_pb2.QueryUsageRequest(account_id=account), timeout=10)
        return sum(row.requests for row in reply.rows)


@pytest.fixture(scope="module")
def two_routers(
    tmp_path_factory: pytest.TempPathFactory, postgres_schemas: SessionSchemas
) -> Iterator[TwoRouters]:
    if not ENGINE_SERVER_BUILT:
        pytest.skip("the engine server (cachet.engine.main) is not built yet")
    url = postgres_schemas.create_now()
    root = tmp_path_factory.mktemp("two-routers")
    router_env = {
        "CACHET_ROUTER_API_KEYS": json.dumps(ACCOUNTS),
        "CACHET_ROUTER_WEBHOOK_SECRET": "two-routers-secret",
        "CACHET_STORE_URL": url,
        # Short leases: the jobs of a killed router are taken again within seconds.
        "CACHET_ROUTER_QUEUE_LEASE_SECONDS": "2",
    }
    stack = CachetStack(root, write_tiny_model(root / TINY_MODEL_ID))
    try:
        stack.start(engines=1, router_env=router_env, usage_env={"CACHET_STORE_URL": url})
        stack.processes["router-b"] = stack.start_router(name="router-b", **router_env)
        yield TwoRouters(stack, url, router_env)
    finally:
        stack.stop()
        print(stack.logs())
        postgres_schemas.drop_now(url)


async def test_two_routers_share_the_queue_and_lease_each_job_once(two_routers: TwoRouters) -> None:
    routers = two_routers.routers
    before = [await asyncio.to_thread(scrape, r.metrics_port, "cachet_router_queue_") for r in routers]
    async with create_channel(routers[0].address) as first, create_channel(routers[1].address) as second:
        stubs = [router_pb2_grpc.InferenceServiceStub(first), router_pb2_grpc.InferenceServiceStub(second)]
        # Batches queued through either router; each read back through the other.
        queued = [
            await stubs[i % 2].QueueRequests(batch_of(50), metadata=auth("shared"), timeout=10)
            for i in range(4)
        ]
        for i, batch in enumerate(queued):
            done = await wait_done(stubs[(i + 1) % 2], batch.request_id, "shared", timeout=120)
            check_completed(done, 50, 4)
    # Results a router stored can rise just after the batch reads done (its commit, then the figure).
    deadline = time.monotonic() + 10
    while True:
        after = [await asyncio.to_thread(scrape, r.metrics_port, "cachet_router_queue_") for r in routers]
        stored = [
            growth(b, a)("cachet_router_queue_results_total", outcome="stored")
            for b, a in zip(before, after, strict=True)
        ]
        if sum(stored) == 200 or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.1)
    assert sum(stored) == 200
    assert all(count > 0 for count in stored), f"one router ran every job: {stored}"
    for b, a in zip(before, after, strict=True):
        assert growth(b, a)("cachet_router_queue_results_total", outcome="duplicate") == 0
    # No job was leased twice, so none ran twice (a job runs only under its lease).
    assert await two_routers.job_attempts([batch.request_id for batch in queued]) == [1] * 200
    assert await two_routers.ledger_requests("acct-shared") == 200


async def test_each_router_killed_mid_drain_in_turn_loses_no_job_and_bills_each_once(
    two_routers: TwoRouters,
) -> None:
    """The issue's drill: 10,000 queued jobs, either router killed -9 (and restarted) during the drain."""
    batches, per_batch = 10, 1000
    async with create_channel(two_routers.routers[0].address) as channel:
        inference = router_pb2_grpc.InferenceServiceStub(channel)
        queued = [
            (await inference.QueueRequests(batch_of(per_batch), metadata=auth("kill"), timeout=30)).request_id
            for _ in range(batches)
        ]
    total = batches * per_batch
    for name in ("router-b", "router"):
        victim = two_routers.stack.processes[name]
        before = await asyncio.to_thread(scrape, victim.metrics_port, "cachet_router_queue_")
        deadline = time.monotonic() + 60
        while True:
            now = await asyncio.to_thread(scrape, victim.metrics_port, "cachet_router_queue_")
            if growth(before, now)("cachet_router_queue_jobs_started_total") > 0:
                break
            assert await two_routers.done_jobs(queued) < total, "the drain ended before the kill"
            assert time.monotonic() < deadline, f"{name} never started a job"
            await asyncio.sleep(0.05)
        victim.stop(signal.SIGKILL)
        assert await two_routers.done_jobs(queued) < total, "the drain ended before the kill"
        two_routers.stack.processes[name] = two_routers.stack.start_router(
            name=name, **two_routers.router_env
        )
    async with create_channel(two_routers.routers[0].address) as channel:
        inference = router_pb2_grpc.InferenceServiceStub(channel)
        for batch_id in queued:
            check_completed(await wait_done(inference, batch_id, "kill", timeout=300), per_batch, 4)
    assert await two_routers.done_jobs(queued) == total
    # The ledger keys usage by job id: a job a dead router had run is billed once all the same.
    deadline = time.monotonic() + 10
    while (billed := await two_routers.ledger_requests("acct-kill")) != total and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    assert billed == total
