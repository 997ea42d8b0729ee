"""Counters follow the ledger: a duplicate is counted as one, and adds no tokens."""

from __future__ import annotations

from pathlib import Path

import pytest
from prometheus_client import REGISTRY

from cachet.grpc_channel import create_channel
from cachet.usage.main import start
from cachet.usage.settings import UsageSettings
from cachet.usage.v1 import usage_pb2, usage_pb2_grpc


def sample(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


async def test_records_duplicates_and_tokens_are_counted(tmp_path: Path) -> None:
    model = "metrics-model"  # a label no other test uses, so the counts start at zero
    running = await start(UsageSettings(port=0, data_dir=tmp_path))
    try:
        async with create_channel(running.address) as channel:
            usage = usage_pb2_grpc.UsageServiceStub(channel)
            record = usage_pb2.UsageRecord(
                request_id="m1",
                account_id="a",
                model=model,
                prompt_tokens=30,
                cached_tokens=20,
                completion_tokens=5,
            )
            for _ in range(3):
                await usage.RecordUsage(usage_pb2.RecordUsageRequest(record=record))
    finally:
        await running.stop(grace=None)
    assert sample("cachet_usage_records_total", model=model) == 1
    assert sample("cachet_usage_duplicate_records_total", model=model) == 2
    assert sample("cachet_usage_tokens_total", model=model, kind="prompt") == 30
    assert sample("cachet_usage_tokens_total", model=model, kind="cached") == 20
    assert sample("cachet_usage_tokens_total", model=model, kind="completion") == 5
    # 10 uncached x $0.60/M + 20 cached x $0.10/M + 5 x $3.00/M; 20 x ($0.60 - $0.10)/M saved.
    assert sample("cachet_usage_cost_usd_total", model=model) == pytest.approx(23e-6)
    assert sample("cachet_usage_cache_savings_usd_total", model=model) == pytest.approx(10e-6)
    assert (tmp_path / "usage.sqlite3").is_file()
