"""The bridge as a real process in front of a real router and usage service, driven by the openai client.

No engine here (engines get their own end-to-end tests): what crosses the bridge
is health, the router's refusals (nothing to serve), the queue's bookkeeping and the
usage ledger, all through real gRPC and real HTTP.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx
import openai
import pytest
from service_processes import ServiceProcess, free_port, launch_service, wait_http_healthy, wait_serving

from cachet.usage.v1 import usage_pb2, usage_pb2_grpc

from .conftest import NOWHERE

DAY_MS = 1_772_366_400_000  # 2026-03-01T12:00:00Z


@dataclass
class Stack:
    usage: ServiceProcess
    router: ServiceProcess
    bridge: ServiceProcess

    @property
    def url(self) -> str:
        return f"http://{self.bridge.address}"


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    data = tmp_path_factory.mktemp("bridge-stack")
    usage_port, router_port, bridge_port = free_port(), free_port(), free_port()
    usage = launch_service(
        "usage", {"CACHET_USAGE_PORT": str(usage_port), "CACHET_DATA_DIR": str(data)}, data, port=usage_port
    )
    router = launch_service(
        "router",
        {
            "CACHET_ROUTER_PORT": str(router_port),
            "CACHET_ROUTER_ENGINE_ADDRESSES": "[]",
            "CACHET_ROUTER_TOKENIZER_ADDRESS": NOWHERE,
            "CACHET_ROUTER_CACHE_ADDRESS": NOWHERE,
            "CACHET_ROUTER_USAGE_ADDRESS": f"127.0.0.1:{usage_port}",
            "CACHET_ROUTER_STARTUP_WAIT_SECONDS": "0",
            "CACHET_DATA_DIR": str(data),
        },
        data,
        port=router_port,
    )
    bridge = launch_service(
        "bridge",
        {
            "CACHET_PORT": str(bridge_port),
            "CACHET_BRIDGE_ROUTER_ADDRESS": f"127.0.0.1:{router_port}",
            "CACHET_BRIDGE_USAGE_ADDRESS": f"127.0.0.1:{usage_port}",
            "CACHET_DATA_DIR": str(data),
        },
        data,
        port=bridge_port,
    )
    try:
        wait_serving(usage, 60)
        wait_serving(router, 60)
        wait_http_healthy(bridge)
        yield Stack(usage, router, bridge)
    finally:
        for service in (bridge, router, usage):
            service.stop()


def client(stack: Stack) -> openai.OpenAI:
    # No retries: a 503 must show up as one, not as three slow attempts.
    return openai.OpenAI(base_url=f"{stack.url}/v1", api_key="dev", max_retries=0, timeout=20)


def test_health_follows_the_router(stack: Stack) -> None:
    response = httpx.get(f"{stack.url}/health", timeout=5)
    assert (response.status_code, response.json()) == (200, {"status": "ok"})


def test_not_ready_until_an_engine_serves_a_model(stack: Stack) -> None:
    # Up (/health), but with no engine a chat request would be refused: /ready says so.
    response = httpx.get(f"{stack.url}/ready", timeout=5)
    assert response.status_code == 503, response.text
    assert response.headers["retry-after"] == "1"
    assert response.json()["error"]["message"] == "no engine replica serves a model yet"
    assert httpx.get(f"{stack.url}/v1/models", timeout=5).json()["data"] == []


def test_queue_request_is_accepted_with_no_engine_and_polled_by_id(stack: Stack) -> None:
    # The queue never answers "out of capacity": with no engine at all the batch waits, queued.
    body = {"requests": [{"prompt": "Tell me a joke"}, {"messages": [{"role": "user", "content": "hi"}]}]}
    queued = httpx.post(f"{stack.url}/ai/run/@cf/meta/m?queueRequest=true", json=body, timeout=10)
    assert queued.status_code == 200, queued.text
    result = queued.json()["result"]
    assert result["status"] == "queued" and result["request_id"].startswith("batch-")
    # A body with only the request_id is a poll, no flag needed.
    polled = httpx.post(
        f"{stack.url}/ai/run/@cf/meta/m",
        json={"request_id": result["request_id"]},
        timeout=10,
    )
    assert polled.status_code == 200, polled.text
    assert polled.json()["result"] == {"request_id": result["request_id"], "status": "queued"}
    unknown = httpx.post(
        f"{stack.url}/ai/run/@cf/meta/m?queueRequest=true", json={"request_id": "b-1"}, timeout=10
    )
    assert unknown.status_code == 404, unknown.text
    assert set(unknown.json()["error"]) == {"message", "type", "param", "code"}


def test_openai_client_sees_openai_errors(stack: Stack) -> None:
    with pytest.raises(openai.BadRequestError) as bad:
        client(stack).chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], n=17)
    assert bad.value.status_code == 400
    assert bad.value.param == "n"
    # Nothing serves a model here: the router's refusal reaches the client as a typed OpenAI error.
    with pytest.raises(openai.APIStatusError) as refused:
        client(stack).chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
    assert refused.value.status_code == 503, refused.value.response.text
    assert refused.value.response.headers["retry-after"] == "1"
    assert set(refused.value.response.json()["error"]) == {"message", "type", "param", "code"}
    with pytest.raises(openai.APIStatusError) as refused_stream:
        list(
            client(stack).chat.completions.create(
                model="m", messages=[{"role": "user", "content": "hi"}], stream=True
            )
        )
    # A stream refused before its first token gets the same status as the plain request, not a 200.
    assert refused_stream.value.status_code == refused.value.status_code


def test_models_list_through_the_router(stack: Stack) -> None:
    page = client(stack).models.list()
    assert page.object == "list"
    assert isinstance(page.data, list)


def _record(usage_address: str, request_id: str, account: str, model: str, cached: int) -> None:
    with grpc.insecure_channel(usage_address) as channel:
        usage_pb2_grpc.UsageServiceStub(channel).RecordUsage(
            usage_pb2.RecordUsageRequest(
                record=usage_pb2.UsageRecord(
                    request_id=request_id,
                    account_id=account,
                    model=model,
                    session_id="s-1",
                    prompt_tokens=1000,
                    cached_tokens=cached,
                    completion_tokens=10,
                    finished_at_ms=DAY_MS,
                    priority="interactive",
                )
            ),
            timeout=10,
        )


def test_usage_is_the_callers_own(stack: Stack) -> None:
    _record(stack.usage.address, "req-1", "anonymous", "m1", cached=800)
    _record(stack.usage.address, "req-2", "anonymous", "m1", cached=0)
    _record(stack.usage.address, "req-3", "someone-else", "m1", cached=0)
    response = httpx.get(
        f"{stack.url}/v1/usage",
        params={"group_by": "model,day", "start": "2026-03-01", "end": "2026-03-02T00:00:00Z"},
        timeout=10,
    )
    assert response.status_code == 200, response.text
    rows = response.json()["data"]
    assert len(rows) == 1
    row = rows[0]
    # Only the development account's two requests; someone-else's is not the caller's to see.
    assert (row["model"], row["day"], row["account_id"]) == ("m1", "2026-03-01", None)
    assert (row["requests"], row["prompt_tokens"], row["cached_tokens"], row["completion_tokens"]) == (
        2,
        2000,
        800,
        20,
    )
    assert row["cost_usd"] == format(row["cost_picousd"] / 10**12, ".12f")
    # A window that excludes the records sums nothing.
    empty = httpx.get(f"{stack.url}/v1/usage", params={"end": str(DAY_MS // 1000 - 1)}, timeout=10)
    assert empty.status_code == 200
    assert all(r["requests"] == 0 for r in empty.json()["data"])


def test_sigterm_stops_the_bridge_cleanly(tmp_path: Path) -> None:
    port = free_port()
    bridge = launch_service(
        "bridge", {"CACHET_PORT": str(port), "CACHET_BRIDGE_ROUTER_ADDRESS": NOWHERE}, tmp_path, port=port
    )
    wait_http_healthy(bridge)
    started = time.monotonic()
    # uvicorn re-raises the signal after its graceful shutdown, so the exit is "killed by SIGTERM".
    assert bridge.stop(signal.SIGTERM) in (0, -signal.SIGTERM), bridge.output()
    assert time.monotonic() - started < 10
    # The lifespan's end ran: the gRPC channels were closed, not dropped.
    assert "Application shutdown complete" in bridge.output()
    assert "OPEN DEVELOPMENT MODE" in bridge.output()


def test_refuses_dev_mode_on_a_public_host(tmp_path: Path) -> None:
    port = free_port()
    bridge = launch_service(
        "bridge",
        {"CACHET_PORT": str(port), "CACHET_BRIDGE_HOST": "0.0.0.0", "CACHET_TLS_ALLOW_PLAINTEXT": "true"},
        tmp_path,
        port=port,
    )
    assert bridge.process.wait(timeout=30) != 0
    assert "refusing to serve without API keys" in bridge.output()
