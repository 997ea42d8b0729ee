"""The router's usage recorder against a real usage service: batches, at-once records, drain."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from service_processes import ServiceProcess, free_port, start_service

from cachet.grpc_channel import create_channel
from cachet.router.usage_recorder import UsageRecorder
from cachet.usage.v1 import usage_pb2, usage_pb2_grpc


@pytest.fixture(scope="module")
def usage_service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServiceProcess]:
    root = tmp_path_factory.mktemp("recorder")
    running = start_service("usage", {"CACHET_DATA_DIR": str(root / "data")}, root)
    yield running
    running.stop()


@pytest.fixture
async def usage_stub(usage_service: ServiceProcess) -> AsyncIterator[usage_pb2_grpc.UsageServiceStub]:
    async with create_channel(usage_service.address) as channel:
        yield usage_pb2_grpc.UsageServiceStub(channel)


def _record(account: str, completion_tokens: int = 5) -> usage_pb2.UsageRecord:
    return usage_pb2.UsageRecord(
        request_id=f"req-{uuid.uuid4().hex}",
        account_id=account,
        model="m",
        prompt_tokens=100,
        cached_tokens=64,
        completion_tokens=completion_tokens,
    )


async def _requests_recorded(stub: usage_pb2_grpc.UsageServiceStub, account: str) -> int:
    rows = (await stub.QueryUsage(usage_pb2.QueryUsageRequest(account_id=account))).rows
    return sum(row.requests for row in rows)


async def test_records_of_one_window_land_together_and_once(usage_stub) -> None:
    account = f"acct-{uuid.uuid4().hex[:8]}"
    recorder = UsageRecorder(usage_stub, timeout_seconds=10, flush_seconds=0.05)
    futures = [recorder.submit(_record(account, tokens)) for tokens in range(1, 6)]
    assert await asyncio.wait_for(asyncio.gather(*futures), 10) == [True] * 5
    assert await _requests_recorded(usage_stub, account) == 5
    rows = (await usage_stub.QueryUsage(usage_pb2.QueryUsageRequest(account_id=account))).rows
    assert sum(row.completion_tokens for row in rows) == 1 + 2 + 3 + 4 + 5


async def test_drain_sends_what_waits_for_the_window(usage_stub) -> None:
    account = f"acct-{uuid.uuid4().hex[:8]}"
    recorder = UsageRecorder(usage_stub, timeout_seconds=10, flush_seconds=3600)
    waiting = [recorder.submit(_record(account)) for _ in range(3)]
    assert not any(future.done() for future in waiting)
    await recorder.drain(timeout=10)
    assert [future.result() for future in waiting] == [True] * 3
    assert await _requests_recorded(usage_stub, account) == 3


async def test_a_full_batch_goes_without_waiting(usage_stub) -> None:
    account = f"acct-{uuid.uuid4().hex[:8]}"
    recorder = UsageRecorder(usage_stub, timeout_seconds=10, flush_seconds=3600, max_batch=4)
    futures = [recorder.submit(_record(account)) for _ in range(4)]
    assert await asyncio.wait_for(asyncio.gather(*futures), 10) == [True] * 4


async def test_an_unreachable_ledger_gives_up_and_says_so(tmp_path: Path) -> None:
    # Nothing listens on this port: every attempt is UNAVAILABLE, and the recorder retries
    # with backoff (0.2 s doubling, five attempts) before it gives up.
    async with create_channel(f"127.0.0.1:{free_port()}") as channel:
        recorder = UsageRecorder(usage_pb2_grpc.UsageServiceStub(channel), timeout_seconds=1, flush_seconds=0)
        assert await asyncio.wait_for(recorder.submit(_record("nobody")), 30) is False


async def test_a_record_the_ledger_refuses_loses_only_itself(usage_stub) -> None:
    account = f"acct-{uuid.uuid4().hex[:8]}"
    recorder = UsageRecorder(usage_stub, timeout_seconds=10, flush_seconds=0.05)
    bad = _record(account)
    bad.request_id = "r" * 600  # over the ledger's 512-character id limit
    futures = [recorder.submit(_record(account)), recorder.submit(bad), recorder.submit(_record(account))]
    assert await asyncio.wait_for(asyncio.gather(*futures), 10) == [True, False, True]
    assert await _requests_recorded(usage_stub, account) == 2
