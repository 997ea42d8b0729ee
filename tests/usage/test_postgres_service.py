"""Usage services on one PostgreSQL database: a request recorded through either is billed once;
a server that cannot be reached fails the start with where it looked, not a traceback."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cachet.durable_postgres import StoreNotOpened
from cachet.grpc_channel import create_channel
from cachet.loopback_port import free_loopback_port
from cachet.usage.main import start
from cachet.usage.settings import UsageSettings
from cachet.usage.v1 import usage_pb2, usage_pb2_grpc


def record(request_id: str) -> usage_pb2.RecordUsageRequest:
    return usage_pb2.RecordUsageRequest(
        record=usage_pb2.UsageRecord(
            request_id=request_id, account_id="acct-pg", model="m", prompt_tokens=100, completion_tokens=10
        )
    )


async def test_two_usage_services_on_one_database_record_each_request_once(
    tmp_path: Path, postgres_url: str
) -> None:
    services = [
        await start(UsageSettings(port=0, data_dir=tmp_path / str(i), store_url=postgres_url))
        for i in range(2)
    ]
    try:
        async with (
            create_channel(services[0].address) as first,
            create_channel(services[1].address) as second,
        ):
            stubs = [usage_pb2_grpc.UsageServiceStub(first), usage_pb2_grpc.UsageServiceStub(second)]
            ids = [f"pg-{i}" for i in range(30)]
            # Every id sent to both services at once: a router's retry landing on another one.
            answers = await asyncio.gather(*(stub.RecordUsage(record(i)) for i in ids for stub in stubs))
            assert sum(not answer.duplicate for answer in answers) == len(ids)
            assert len({answer.cost_picousd for answer in answers}) == 1
            for stub in stubs:
                totals = await stub.QueryUsage(usage_pb2.QueryUsageRequest(account_id="acct-pg"))
                [row] = totals.rows
                assert (row.requests, row.prompt_tokens, row.completion_tokens) == (len(ids), 3000, 300)
    finally:
        for service in services:
            await service.stop(grace=None)
    # Nothing went to the SQLite default.
    assert not (tmp_path / "0" / "usage.sqlite3").exists()


async def test_an_unreachable_database_fails_the_start_saying_where(tmp_path: Path) -> None:
    port = free_loopback_port()  # nothing listens there
    settings = UsageSettings(
        port=0, data_dir=tmp_path, store_url=f"postgresql://root:secret@127.0.0.1:{port}/test"
    )
    with pytest.raises(StoreNotOpened, match=f"ledger store at 127.0.0.1:{port}/test") as raised:
        await start(settings)
    assert "secret" not in str(raised.value)


def test_the_usage_process_says_in_one_line_that_its_database_is_unreachable(tmp_path: Path) -> None:
    port = free_loopback_port()
    env = os.environ | {
        "CACHET_USAGE_PORT": "0",
        "CACHET_DATA_DIR": str(tmp_path),
        "CACHET_STORE_URL": f"postgresql://root@127.0.0.1:{port}/test",
    }
    ended = subprocess.run(
        [sys.executable, "-m", "cachet.usage"], env=env, capture_output=True, text=True, timeout=60
    )
    assert ended.returncode == 1
    assert f"cachet usage: cannot reach the PostgreSQL ledger store at 127.0.0.1:{port}/test" in ended.stderr
    assert "Traceback" not in ended.stderr
