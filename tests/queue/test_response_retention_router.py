"""A real router purges stored Responses past its retention from its store (SQLite or
PostgreSQL) once it starts, and keeps the younger ones: the first is NOT_FOUND over gRPC
within seconds, as OpenAI's expire after 30 days."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import grpc
import pytest
from service_processes import start_service

from cachet.grpc_channel import create_channel
from cachet.loopback_port import free_loopback_port
from cachet.router.postgres_queue_store import PostgresQueueStore
from cachet.router.queue_store import QueueStore, StoredResponse
from cachet.router.sqlite_queue_store import SqliteQueueStore
from cachet.router.v1 import router_pb2, router_pb2_grpc

DAY = 86_400
AUTH = (("authorization", "Bearer sk-a"),)


@pytest.fixture(params=["sqlite", "postgresql"])
def store_env(request: pytest.FixtureRequest, tmp_path: Path) -> dict[str, str]:
    if request.param == "sqlite":
        return {}
    return {"CACHET_STORE_URL": request.getfixturevalue("postgres_url")}


async def open_store(env: dict[str, str], data_dir: Path) -> QueueStore:
    if "CACHET_STORE_URL" in env:
        return await PostgresQueueStore.open(env["CACHET_STORE_URL"])
    return SqliteQueueStore(data_dir / "queue.sqlite3")


async def test_a_router_purges_responses_past_its_retention(
    store_env: dict[str, str], tmp_path: Path
) -> None:
    store = await open_store(store_env, tmp_path)
    now = int(time.time())
    for response_id, age in (("resp_old", 8 * DAY), ("resp_young", 6 * DAY)):
        await store.put_response("acct-a", StoredResponse(response_id, now - age, "s1", b"{}"))
    await store.close()
    nowhere = f"127.0.0.1:{free_loopback_port()}"
    env = {
        "CACHET_ROUTER_ENGINE_ADDRESSES": json.dumps([nowhere]),
        "CACHET_ROUTER_TOKENIZER_ADDRESS": nowhere,
        "CACHET_ROUTER_USAGE_ADDRESS": nowhere,
        "CACHET_ROUTER_CACHE_ADDRESS": nowhere,
        "CACHET_ROUTER_STARTUP_WAIT_SECONDS": "0",
        "CACHET_ROUTER_API_KEYS": json.dumps({"sk-a": "acct-a"}),
        "CACHET_ROUTER_RESPONSES_RETENTION_DAYS": "7",
        "CACHET_DATA_DIR": str(tmp_path),
    } | store_env
    router = start_service("router", env, tmp_path)
    try:
        async with create_channel(router.address) as channel:
            stub = router_pb2_grpc.InferenceServiceStub(channel)
            await wait_gone(stub, "resp_old")
            young = await stub.GetStoredResponse(
                router_pb2.GetStoredResponseRequest(response_id="resp_young"), metadata=AUTH, timeout=10
            )
            assert young.id == "resp_young"
    finally:
        assert router.stop() == 0, router.log_tail()
    assert "expired stored responses purged" in router.output()


async def wait_gone(stub: router_pb2_grpc.InferenceServiceStub, response_id: str) -> None:
    request = router_pb2.GetStoredResponseRequest(response_id=response_id)
    deadline = time.monotonic() + 20
    while True:
        try:
            await stub.GetStoredResponse(request, metadata=AUTH, timeout=10)
        except grpc.aio.AioRpcError as error:
            assert error.code() == grpc.StatusCode.NOT_FOUND, error
            return
        assert time.monotonic() < deadline, f"{response_id} still stored 20 s after the router started"
        await asyncio.sleep(0.1)
