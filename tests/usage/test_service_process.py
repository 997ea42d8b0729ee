"""The usage service as a real process: gRPC contract, bad input, kill -9 and retry."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from cachet.errors import error_info_from_metadata
from cachet.grpc_channel import create_channel
from cachet.loopback_port import free_loopback_port
from cachet.usage.v1 import usage_pb2, usage_pb2_grpc

SERVICE = "cachet.usage.v1.UsageService"
DAY_MS = 1_772_366_400_000  # 2026-03-01T12:00:00Z


@dataclass
class UsageProcess:
    process: subprocess.Popen[bytes]
    address: str
    log: Path

    def stop(self, signum: int = signal.SIGTERM) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signum)
        return self.process.wait(timeout=15)


def launch(data_dir: Path, log_name: str = "usage.log") -> UsageProcess:
    """Start ``python -m cachet.usage`` on a free port and wait until health says SERVING."""
    port = free_loopback_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("CACHET_")}
    env |= {"CACHET_USAGE_PORT": str(port), "CACHET_DATA_DIR": str(data_dir)}
    log = data_dir / log_name
    with log.open("wb") as sink:
        process = subprocess.Popen([sys.executable, "-m", "cachet.usage"], env=env, stdout=sink, stderr=sink)
    running = UsageProcess(process, f"127.0.0.1:{port}", log)
    _wait_serving(running)
    return running


def _wait_serving(running: UsageProcess, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    with grpc.insecure_channel(running.address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            if running.process.poll() is not None:
                pytest.fail(f"usage exited with {running.process.returncode}:\n{running.log.read_text()}")
            try:
                reply = health.Check(health_pb2.HealthCheckRequest(service=SERVICE), timeout=1)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.05)
    running.stop(signal.SIGKILL)
    pytest.fail(f"usage not serving after {timeout}s:\n{running.log.read_text()}")


def record(request_id: str, **fields: object) -> usage_pb2.RecordUsageRequest:
    values: dict[str, object] = {
        "account_id": "acct-a",
        "model": "m1",
        "prompt_tokens": 1000,
        "cached_tokens": 600,
        "completion_tokens": 50,
        "finished_at_ms": DAY_MS,
    }
    values.update(fields)
    return usage_pb2.RecordUsageRequest(record=usage_pb2.UsageRecord(request_id=request_id, **values))


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[UsageProcess]:
    data_dir = tmp_path_factory.mktemp("usage")
    (data_dir / "prices.json").write_text('{"models": {"premium": {"output_microusd_per_mtok": 9000000}}}')
    running = launch(data_dir)
    yield running
    assert running.stop() == 0, running.log.read_text()


async def test_record_query_and_prices_over_grpc(service: UsageProcess) -> None:
    async with create_channel(service.address) as channel:
        usage = usage_pb2_grpc.UsageServiceStub(channel)
        first = await usage.RecordUsage(record("g1", account_id="grpc", session_id="s1"))
        assert (first.duplicate, first.cost_picousd) == (
            False,
            400 * 600_000 + 600 * 100_000 + 50 * 3_000_000,
        )
        again = await usage.RecordUsage(record("g1", account_id="grpc", session_id="s1"))
        assert (again.duplicate, again.cost_picousd) == (True, first.cost_picousd)
        premium = await usage.RecordUsage(record("g2", account_id="grpc", model="premium", session_id="s2"))
        assert premium.cost_picousd == 400 * 600_000 + 600 * 100_000 + 50 * 9_000_000

        reply = await usage.QueryUsage(
            usage_pb2.QueryUsageRequest(account_id="grpc", group_by=["model", "day"])
        )
        assert [(r.model, r.day, r.requests, r.cost_picousd) for r in reply.rows] == [
            ("m1", "2026-03-01", 1, first.cost_picousd),
            ("premium", "2026-03-01", 1, premium.cost_picousd),
        ]
        assert all(r.cache_savings_picousd == 600 * 500_000 and r.account_id == "" for r in reply.rows)
        by_session = await usage.QueryUsage(
            usage_pb2.QueryUsageRequest(account_id="grpc", group_by=["session"])
        )
        assert [(r.session_id, r.requests) for r in by_session.rows] == [("s1", 1), ("s2", 1)]

        prices = await usage.ListPrices(usage_pb2.ListPricesRequest())
        assert [(p.model, p.output_microusd_per_mtok) for p in prices.prices] == [("premium", 9_000_000)]
        assert prices.default_price.input_microusd_per_mtok == 600_000
        assert prices.default_price.cached_input_microusd_per_mtok == 100_000


async def test_a_batch_records_each_once_and_a_bad_record_refuses_it_whole(service: UsageProcess) -> None:
    async with create_channel(service.address) as channel:
        usage = usage_pb2_grpc.UsageServiceStub(channel)
        await usage.RecordUsage(record("b0", account_id="batched"))
        records = [record(f"b{i}", account_id="batched").record for i in range(3)]
        # b0 is in the ledger already; the second b2 is a retry inside the same batch.
        reply = await usage.RecordUsageBatch(
            usage_pb2.RecordUsageBatchRequest(records=[*records, records[2]])
        )
        assert [result.duplicate for result in reply.results] == [True, False, False, True]
        assert len({result.cost_picousd for result in reply.results}) == 1

        bad = [record("b3", account_id="batched").record, record("b4", account_id="batched", model="").record]
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await usage.RecordUsageBatch(usage_pb2.RecordUsageBatchRequest(records=bad))
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert error_info_from_metadata(refused.value.trailing_metadata()).param == "records[1].model"
        [row] = (await usage.QueryUsage(usage_pb2.QueryUsageRequest(account_id="batched"))).rows
        assert row.requests == 3  # b0..b2 once each, nothing of the refused batch


async def test_unset_finish_time_is_stamped_by_the_server(service: UsageProcess) -> None:
    before = int(time.time() * 1000)
    async with create_channel(service.address) as channel:
        usage = usage_pb2_grpc.UsageServiceStub(channel)
        await usage.RecordUsage(record("now", account_id="clock", finished_at_ms=0))
        [row] = (
            await usage.QueryUsage(usage_pb2.QueryUsageRequest(account_id="clock", start_ms=before))
        ).rows
        assert row.requests == 1


@pytest.mark.parametrize(
    ("request_", "field"),
    [
        (record(""), "request_id"),
        (record("x", account_id=""), "account_id"),
        (record("x", model=""), "model"),
        (record("x", prompt_tokens=10, cached_tokens=11), "cached_tokens"),
    ],
    ids=["empty-request-id", "empty-account", "empty-model", "cached-over-prompt"],
)
async def test_bad_records_are_invalid_argument_naming_the_field(
    service: UsageProcess, request_: usage_pb2.RecordUsageRequest, field: str
) -> None:
    async with create_channel(service.address) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as bad:
            await usage_pb2_grpc.UsageServiceStub(channel).RecordUsage(request_)
    assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in bad.value.details()
    assert error_info_from_metadata(bad.value.trailing_metadata()).param == field


@pytest.mark.parametrize(
    ("query", "field"),
    [
        (usage_pb2.QueryUsageRequest(group_by=["account", "week"]), "group_by"),
        (usage_pb2.QueryUsageRequest(start_ms=10, end_ms=5), "end_ms"),
    ],
    ids=["unknown-group", "empty-range"],
)
async def test_bad_queries_are_invalid_argument(service: UsageProcess, query, field: str) -> None:
    async with create_channel(service.address) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as bad:
            await usage_pb2_grpc.UsageServiceStub(channel).QueryUsage(query)
    assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in bad.value.details()
    if field == "group_by":
        assert "'week'" in bad.value.details()


async def _record_all(address: str, requests: list[usage_pb2.RecordUsageRequest]) -> list[bool]:
    async with create_channel(address) as channel:
        usage = usage_pb2_grpc.UsageServiceStub(channel)
        replies = await asyncio.gather(*(usage.RecordUsage(r, timeout=10) for r in requests))
    return [reply.duplicate for reply in replies]


async def _totals(address: str) -> usage_pb2.UsageRow:
    async with create_channel(address) as channel:
        reply = await usage_pb2_grpc.UsageServiceStub(channel).QueryUsage(usage_pb2.QueryUsageRequest())
    [row] = reply.rows
    return row


async def test_kill_9_loses_nothing_and_retries_count_once(tmp_path: Path) -> None:
    first_batch = [record(f"k{i}", completion_tokens=i) for i in range(60)]
    running = launch(tmp_path, "first.log")
    try:
        # Concurrent writers, some of them repeats of each other, then no clean shutdown at all.
        duplicates = await _record_all(running.address, first_batch + first_batch[:20])
        assert duplicates.count(False) == 60
    finally:
        assert running.stop(signal.SIGKILL) == -signal.SIGKILL

    restarted = launch(tmp_path, "second.log")
    try:
        before = await _totals(restarted.address)
        assert before.requests == 60
        assert before.completion_tokens == sum(range(60))
        # The caller never saw its answers (say the kill cut them off) and retries them all, plus new work.
        second_batch = [record(f"n{i}") for i in range(10)]
        duplicates = await _record_all(restarted.address, first_batch + second_batch)
        assert duplicates == [True] * 60 + [False] * 10
        after = await _totals(restarted.address)
        assert after.requests == 70
        assert after.cost_picousd == sum(400 * 600_000 + 600 * 100_000 + i * 3_000_000 for i in range(60)) + (
            10 * 450_000_000
        )
    finally:
        assert restarted.stop() == 0, restarted.log.read_text()
