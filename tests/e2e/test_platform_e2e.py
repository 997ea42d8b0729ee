"""The whole platform as a user meets it: bridge -> router -> tokenizer / cache / two engines / usage.

One stack per module (real processes on the tiny model, over loopback), shared by
every test; the test that kills an engine runs last. Engines take one running and
one waiting request each, so "over capacity" is four requests away. Every span of
every process lands in one JSON-lines file (``CACHET_TRACE_FILE``), and the usage
service bills at odd integer prices, so a swapped price or a lost token shows.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import httpx
import openai
import pytest
from service_processes import (
    ENGINE_SERVER_BUILT,
    TINY_MODEL_ID,
    CachetStack,
    ServiceProcess,
    free_port,
    start_service,
)

from cachet.cache.v1 import cache_pb2, cache_pb2_grpc
from cachet.engine.v1 import engine_pb2, engine_pb2_grpc
from cachet.models.tiny import write_tiny_model
from cachet.usage.v1 import usage_pb2, usage_pb2_grpc

TIMEOUT = 60.0
KEY, ACCOUNT = "sk-e2e", "acct-e2e"
# Only the ledger test bills this account, so its totals are that test's requests alone.
LEDGER_KEY, LEDGER_ACCOUNT = "sk-ledger", "acct-ledger"
API_KEYS = {KEY: ACCOUNT, LEDGER_KEY: LEDGER_ACCOUNT}
# Pico-USD per token. Distinct odd numbers: billing cached tokens at the input price
# (or output at input) changes the total, which the ledger test would catch.
INPUT_PRICE, CACHED_PRICE, OUTPUT_PRICE = 700_001, 123_457, 2_999_999
MAX_BODY_BYTES = 64 * 1024
SERVICES = ("bridge", "router", "tokenizer", "engine", "usage")


@dataclass
class Platform:
    stack: CachetStack
    bridge: ServiceProcess
    trace_file: Path

    @property
    def url(self) -> str:
        return f"http://{self.bridge.address}"

    def client(self, key: str = KEY) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=key, max_retries=0, timeout=TIMEOUT)

    def engine(self, name: str) -> ServiceProcess:
        return self.stack.processes[name]


def _start_platform(root: Path) -> Platform:
    """Like ``CachetStack.start`` but every process writes spans to one file and keys are configured."""
    trace_file = root / "spans.jsonl"
    traced = {"CACHET_TRACE_FILE": str(trace_file)}
    prices = root / "prices.json"
    prices.write_text(
        json.dumps(
            {
                "models": {
                    TINY_MODEL_ID: {
                        "input_microusd_per_mtok": INPUT_PRICE,
                        "cached_input_microusd_per_mtok": CACHED_PRICE,
                        "output_microusd_per_mtok": OUTPUT_PRICE,
                    }
                }
            }
        )
    )
    stack = CachetStack(root, write_tiny_model(root / TINY_MODEL_ID))
    add = stack._add  # noqa: SLF001 - the stack's own registry; its start() cannot pass our variables
    try:
        usage_env = {"CACHET_DATA_DIR": str(root / "usage-data"), "CACHET_USAGE_PRICES_FILE": str(prices)}
        engine_env = traced | {
            "CACHET_MODEL": str(stack.model_dir),
            "CACHET_ENGINE_MAX_NUM_SEQS": "1",
            "CACHET_ENGINE_MAX_WAITING": "1",
            "CACHET_ENGINE_LOAD_REPORT_INTERVAL_MS": "50",
        }
        # The leaves of the dependency graph start together: most of their start-up is imports.
        leaves = {
            "tokenizer": (
                "tokenizer",
                traced | {"CACHET_TOKENIZER_MODELS": json.dumps([str(stack.model_dir)])},
            ),
            "usage": ("usage", traced | usage_env),
            "engine0": ("engine", engine_env),
            "engine1": ("engine", engine_env),
        }
        with ThreadPoolExecutor(len(leaves)) as pool:
            started = {
                name: pool.submit(start_service, service, env, root, name=name, timeout=300)
                for name, (service, env) in leaves.items()
            }
        failures = [future.exception() for future in started.values() if future.exception() is not None]
        for future in started.values():
            if future.exception() is None:
                add(future.result())
        if failures:
            raise failures[0]
        add(
            start_service(
                "cache", traced | {"CACHET_CACHE_ENGINE_ADDRESSES": json.dumps(stack.engine_addresses)}, root
            )
        )
        add(stack.start_router(CACHET_TRACE_FILE=str(trace_file), CACHET_API_KEYS=json.dumps(API_KEYS)))
        port = free_port()
        bridge_env = traced | {
            "CACHET_PORT": str(port),
            "CACHET_BRIDGE_ROUTER_ADDRESS": stack.address("router"),
            "CACHET_BRIDGE_USAGE_ADDRESS": stack.address("usage"),
            "CACHET_API_KEYS": json.dumps(API_KEYS),
            "CACHET_BRIDGE_MAX_BODY_BYTES": str(MAX_BODY_BYTES),
        }
        bridge = _start_bridge(bridge_env, root, port)
        add(bridge)
    except BaseException:
        stack.stop()
        raise
    return Platform(stack, bridge, trace_file)


def _start_bridge(env: dict[str, str], root: Path, port: int) -> ServiceProcess:
    # start_service waits on gRPC health; the bridge speaks HTTP, so wait on /health here.
    base = {k: v for k, v in os.environ.items() if not k.startswith("CACHET_")}
    log = root / "bridge.log"
    with log.open("wb") as sink:
        process = subprocess.Popen(
            [sys.executable, "-m", "cachet.bridge"], env=base | env, stdout=sink, stderr=subprocess.STDOUT
        )
    bridge = ServiceProcess("bridge", process, f"127.0.0.1:{port}", log)
    deadline = time.monotonic() + 60
    while True:
        assert process.poll() is None, bridge.log_tail()
        try:
            if httpx.get(f"http://{bridge.address}/health", timeout=2).status_code == 200:
                return bridge
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, f"bridge never healthy:\n{bridge.log_tail()}"
        time.sleep(0.1)


@pytest.fixture(scope="module")
def platform(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Platform]:
    if not ENGINE_SERVER_BUILT:
        pytest.skip("the engine server (cachet.engine.main) is not built yet")
    running = _start_platform(tmp_path_factory.mktemp("platform-e2e"))
    yield running
    running.stack.stop()
    print(running.stack.logs())


def chat(question: str = "What is the capital of France?", nonce: str | None = None) -> list[dict[str, str]]:
    # A fresh nonce leads the prompt, so only requests meant to share a cached prefix do.
    system = (
        f"[{nonce or uuid.uuid4().hex}] You are a terse assistant. Answer in one short sentence, no more."
    )
    return [{"role": "system", "content": system}, {"role": "user", "content": question}]


def auth(key: str = KEY) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def engine_load(address: str) -> tuple[int, int]:
    """(running, waiting) from the engine's own next load report."""
    with grpc.insecure_channel(address) as channel:
        reports = engine_pb2_grpc.EngineServiceStub(channel).StreamLoadReports(
            engine_pb2.StreamLoadReportsRequest(interval_ms=50), timeout=10
        )
        report = next(iter(reports))
        reports.cancel()
    return report.running_requests, report.waiting_requests


def wait_idle(platform: Platform) -> None:
    deadline = time.monotonic() + 30
    for name in ("engine0", "engine1"):
        while engine_load(platform.engine(name).address) != (0, 0):
            assert time.monotonic() < deadline, f"{name} never went idle"
            time.sleep(0.05)


# -- 1. one trace across every service --------------------------------------------------------


def read_spans(trace_file: Path, trace_id: str) -> list[dict[str, Any]]:
    lines = trace_file.read_text().splitlines() if trace_file.exists() else []
    return [span for span in map(json.loads, lines) if span["trace_id"] == trace_id]


def test_one_trace_spans_bridge_router_tokenizer_engine_and_usage(platform: Platform) -> None:
    trace_id, caller_span = uuid.uuid4().hex, uuid.uuid4().hex[:16]
    headers = auth() | {"traceparent": f"00-{trace_id}-{caller_span}-01"}
    body = {"model": TINY_MODEL_ID, "messages": chat(), "max_tokens": 3, "ignore_eos": True}
    response = httpx.post(f"{platform.url}/v1/chat/completions", json=body, headers=headers, timeout=TIMEOUT)
    assert response.status_code == 200, response.text
    # One unary or fully read call per service must chain back to the caller.
    required = {
        "tokenizer": "/cachet.tokenizer.v1.TokenizerService/ApplyChatTemplate",
        "engine": "/cachet.engine.v1.EngineService/Generate",
    }
    deadline = time.monotonic() + 10
    while True:
        spans = read_spans(platform.trace_file, trace_id)
        by_id = {span["span_id"]: span for span in spans}
        servers = [s for s in spans if s["service"] in required and s["kind"] == "SERVER"]
        complete = [s for s in servers if _ancestry(s, by_id)[-1]["parent_span_id"] == caller_span]
        # The usage record travels in a batch; its ledger span carries the request's context.
        records = [s for s in spans if (s["service"], s["name"]) == ("usage", "cachet.usage.record")]
        records = [s for s in records if _ancestry(s, by_id)[-1]["parent_span_id"] == caller_span]
        # A client span is written when it ends, after the server span it called: poll for stragglers.
        if {(s["service"], s["name"]) for s in complete} >= set(required.items()) and records:
            break
        assert time.monotonic() < deadline, [(s["service"], s["kind"], s["name"]) for s in spans]
        time.sleep(0.1)
    # The record's span hangs off the router's span of the request, which the bridge called.
    record_line = _ancestry(records[0], by_id)
    assert [(s["service"], s["kind"]) for s in record_line[1:]][:1] == [("router", "SERVER")]
    assert record_line[-1]["service"] == "bridge"
    assert {s["service"] for s in spans} >= set(SERVICES)
    for span in complete:
        line = _ancestry(span, by_id)
        # The context crossed gRPC: each server span's parent is the router's client span of that call.
        assert (line[1]["service"], line[1]["kind"], line[1]["name"]) == ("router", "CLIENT", span["name"])
        hops = [s["service"] for s in line]
        merged = [svc for i, svc in enumerate(hops) if i == 0 or hops[i - 1] != svc]
        assert merged == [span["service"], "router", "bridge"], hops
        router_server = next(s for s in line if s["service"] == "router" and s["kind"] == "SERVER")
        assert router_server["name"] == "/cachet.router.v1.InferenceService/CreateChatCompletion"
        assert by_id[router_server["parent_span_id"]]["kind"] == "CLIENT"
        # The chain ends in the bridge's HTTP server span, a child of the caller's traceparent.
        root = line[-1]
        assert (root["service"], root["kind"], root["name"]) == (
            "bridge",
            "SERVER",
            "POST /v1/chat/completions",
        )
    # Inside the engine: the request's stages, children of its Generate span, one after another.
    generate = next(s for s in complete if s["service"] == "engine")
    stages = {s["name"]: s for s in spans if s["parent_span_id"] == generate["span_id"]}
    order = ["engine.queue", "engine.prefill", "engine.decode"]
    assert set(order) <= set(stages), sorted(stages)
    for earlier, later in zip(order, order[1:], strict=False):
        assert stages[earlier]["end_ns"] <= stages[later]["start_ns"] + 1_000, (earlier, later)
    assert generate["start_ns"] <= stages["engine.queue"]["start_ns"]
    assert stages["engine.decode"]["attributes"]["cachet.completion_tokens"] == 3
    assert stages["engine.prefill"]["attributes"]["cachet.prefill_chunks"] >= 1


def _ancestry(span: dict[str, Any], by_id: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """``span`` and its ancestors, up to the first whose parent has not been written (or is the caller's)."""
    line = [span]
    while line[-1]["parent_span_id"] in by_id:
        line.append(by_id[line[-1]["parent_span_id"]])
    return line


# -- 2. the ledger against what the clients were told -----------------------------------------


def test_usage_ledger_totals_equal_what_clients_received_and_replays_count_once(platform: Platform) -> None:
    client = platform.client(LEDGER_KEY)
    shared = chat("Name a colour.")
    received: list[tuple[str, int, int, int]] = []  # (request id, prompt, cached, completion)
    # The same prompt twice on one session: the second lands on the replica that served the
    # first and is partly served from its cache. Without the session the choice rests on the
    # cache index, which may not have heard the first request's KV events yet.
    session = {"x-session-affinity": f"ledger-{uuid.uuid4()}"}
    for _ in range(2):
        done = client.chat.completions.create(
            model=TINY_MODEL_ID,
            messages=shared,
            max_tokens=4,
            temperature=0,
            extra_body={"ignore_eos": True},
            extra_headers=session,
        )
        details = done.usage.prompt_tokens_details
        received.append(
            (done.id, done.usage.prompt_tokens, details.cached_tokens, done.usage.completion_tokens)
        )
    chunks = list(
        client.chat.completions.create(
            model=TINY_MODEL_ID,
            messages=chat(),
            max_tokens=5,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    usage = chunks[-1].usage
    received.append(
        (
            chunks[0].id,
            usage.prompt_tokens,
            usage.prompt_tokens_details.cached_tokens,
            usage.completion_tokens,
        )
    )
    text = client.completions.create(
        model=TINY_MODEL_ID,
        prompt=f"{uuid.uuid4()} Once upon a time",
        max_tokens=3,
        extra_body={"ignore_eos": True},
    )
    received.append((text.id, text.usage.prompt_tokens, 0, text.usage.completion_tokens))
    assert received[1][2] > 0, "the repeated prompt should have been served partly from the cache"
    assert len({r[0] for r in received}) == len(received)

    prompt = sum(r[1] for r in received)
    cached = sum(r[2] for r in received)
    completion = sum(r[3] for r in received)
    # The bill, by hand: uncached input, cached input and output each at their own integer price.
    cost = (prompt - cached) * INPUT_PRICE + cached * CACHED_PRICE + completion * OUTPUT_PRICE
    savings = cached * (INPUT_PRICE - CACHED_PRICE)

    def ledger() -> dict[str, Any]:
        rows = httpx.get(f"{platform.url}/v1/usage", headers=auth(LEDGER_KEY), timeout=TIMEOUT).json()["data"]
        assert len(rows) <= 1, rows
        return rows[0] if rows else {"requests": 0}

    # The router waits up to a second for each record, then keeps retrying in the background.
    deadline = time.monotonic() + 10
    while (row := ledger())["requests"] < len(received):
        assert time.monotonic() < deadline, row
        time.sleep(0.1)
    assert (row["requests"], row["prompt_tokens"], row["cached_tokens"], row["completion_tokens"]) == (
        len(received),
        prompt,
        cached,
        completion,
    )
    assert (row["cost_picousd"], row["cache_savings_picousd"]) == (cost, savings)

    # A replayed write (a retry after a lost answer) with the same request id changes nothing,
    # even when it carries different numbers.
    first_id, first_prompt, first_cached, first_completion = received[0]
    replay = usage_pb2.UsageRecord(
        request_id=first_id,
        account_id=LEDGER_ACCOUNT,
        model=TINY_MODEL_ID,
        prompt_tokens=first_prompt + 100,
        cached_tokens=first_cached,
        completion_tokens=first_completion + 100,
        finished_at_ms=int(time.time() * 1000),
    )
    with grpc.insecure_channel(platform.stack.address("usage")) as channel:
        usage_stub = usage_pb2_grpc.UsageServiceStub(channel)
        answer = usage_stub.RecordUsage(usage_pb2.RecordUsageRequest(record=replay), timeout=10)
        assert answer.duplicate
        rows = usage_stub.QueryUsage(
            usage_pb2.QueryUsageRequest(account_id=LEDGER_ACCOUNT, group_by=["model"]), timeout=10
        ).rows
    assert [(r.model, r.requests, r.prompt_tokens, r.completion_tokens, r.cost_picousd) for r in rows] == [
        (TINY_MODEL_ID, len(received), prompt, completion, cost)
    ]


# -- 3. bad input, OpenAI-shaped ---------------------------------------------------------------

CHAT_URL = "/v1/chat/completions"
GOOD = {"model": TINY_MODEL_ID, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}


def _case(body: dict[str, Any], status: int, error_type: str, param: str | None) -> tuple:
    return (json.dumps(body).encode(), auth(), status, error_type, param)


BAD_INPUT = {
    "malformed JSON": (b'{"model": "tiny-llama", "messages": [', auth(), 400, "invalid_request_error", None),
    "body not an object": (b"[1, 2]", auth(), 400, "invalid_request_error", None),
    "messages wrong type": _case(GOOD | {"messages": "hi"}, 400, "invalid_request_error", "messages"),
    "max_tokens wrong type": _case(GOOD | {"max_tokens": "lots"}, 400, "invalid_request_error", "max_tokens"),
    "unknown model": _case(GOOD | {"model": "no-such-model"}, 404, "not_found_error", "model"),
    "empty messages": _case(GOOD | {"messages": []}, 400, "invalid_request_error", "messages"),
    "bad role": _case(
        GOOD | {"messages": [{"role": "robot", "content": "x"}]},
        400,
        "invalid_request_error",
        "messages[0].role",
    ),
    "n past 16": _case(GOOD | {"n": 17}, 400, "invalid_request_error", "n"),
    "logit_bias": _case(GOOD | {"logit_bias": {"5": 1}}, 400, "invalid_request_error", "logit_bias"),
    "negative max_tokens": _case(GOOD | {"max_tokens": -1}, 400, "invalid_request_error", "max_tokens"),
    "temperature out of range": _case(
        GOOD | {"temperature": 2.5}, 400, "invalid_request_error", "temperature"
    ),
    "tool without function": _case(
        GOOD | {"tools": [{"type": "function"}]}, 400, "invalid_request_error", "tools[0].function"
    ),
    "tool of unknown type": _case(
        GOOD | {"tools": [{"type": "shell", "function": {"name": "f"}}]},
        400,
        "invalid_request_error",
        "tools[0].type",
    ),
    "response_format unknown type": _case(
        GOOD | {"response_format": {"type": "xml"}}, 400, "invalid_request_error", "response_format"
    ),
    "json_schema without schema": _case(
        GOOD | {"response_format": {"type": "json_schema"}},
        400,
        "invalid_request_error",
        "response_format.json_schema",
    ),
    "prompt over the context window": _case(
        GOOD | {"messages": [{"role": "user", "content": "hi " * 2500}]},
        400,
        "invalid_request_error",
        "messages",
    ),
    "oversized body": (
        json.dumps(GOOD | {"messages": [{"role": "user", "content": "x" * MAX_BODY_BYTES}]}).encode(),
        auth(),
        413,
        "invalid_request_error",
        None,
    ),
    "missing API key": (json.dumps(GOOD).encode(), {}, 401, "authentication_error", None),
    "unknown API key": (json.dumps(GOOD).encode(), auth("sk-nobody"), 401, "authentication_error", None),
}


@pytest.mark.parametrize(
    ("body", "headers", "status", "error_type", "param"), BAD_INPUT.values(), ids=BAD_INPUT
)
def test_bad_input_gets_its_openai_error(
    platform: Platform, body: bytes, headers: dict[str, str], status: int, error_type: str, param: str | None
) -> None:
    response = httpx.post(
        f"{platform.url}{CHAT_URL}",
        content=body,
        headers=headers | {"Content-Type": "application/json"},
        timeout=TIMEOUT,
    )
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["type"], error["param"]) == (error_type, param), error
    assert error["message"]


async def test_over_capacity_is_429_with_retry_after(platform: Platform) -> None:
    wait_idle(platform)
    long = {"model": TINY_MODEL_ID, "max_tokens": 1900, "ignore_eos": True, "stream": True}
    async with httpx.AsyncClient(base_url=platform.url, headers=auth(), timeout=TIMEOUT) as client:

        async def occupy() -> None:
            async with client.stream("POST", CHAT_URL, json=long | {"messages": chat()}) as response:
                async for _ in response.aiter_bytes():
                    pass

        def loads() -> list[tuple[int, int]]:
            return sorted(engine_load(platform.engine(n).address) for n in ("engine0", "engine1"))

        # One running and one waiting request on each engine: every replica is saturated.
        # One at a time: the bound is on an engine's waiting queue, and two requests that
        # reach it between the same two steps both count as waiting, a free seat or not.
        holders: list[asyncio.Task[None]] = []
        try:
            for count in range(1, 5):
                holders.append(asyncio.create_task(occupy()))
                deadline = time.monotonic() + 30
                while sum(running + waiting for running, waiting in loads()) < count:
                    assert time.monotonic() < deadline, f"the engines never took request {count}"
                    await asyncio.sleep(0.05)
            assert loads() == [(1, 1), (1, 1)]
            refused = await client.post(CHAT_URL, json=GOOD | {"messages": chat()})
        finally:
            for holder in holders:
                holder.cancel()
            await asyncio.gather(*holders, return_exceptions=True)
    assert refused.status_code == 429, refused.text
    assert int(refused.headers["Retry-After"]) >= 1
    error = refused.json()["error"]
    assert error["type"] == "rate_limit_exceeded" and "capacity" in error["message"]
    # The client disconnects above cancel the generations; nothing is left running.
    wait_idle(platform)


# -- 4. a replica dies mid-stream (last: it leaves one engine) --------------------------------


def sse_events(raw: str) -> list[str]:
    events = raw.split("\n\n")
    assert events[-1] == "", f"the stream did not end on an event boundary: {raw[-200:]!r}"
    return [event.removeprefix("data: ") for event in events[:-1]]


def test_killing_a_replica_mid_stream(platform: Platform) -> None:
    wait_idle(platform)
    addresses = {name: platform.engine(name).address for name in ("engine0", "engine1")}
    body = {
        "model": TINY_MODEL_ID,
        "messages": chat(),
        "max_tokens": 1900,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.stream(
        "POST", f"{platform.url}{CHAT_URL}", json=body, headers=auth(), timeout=TIMEOUT
    ) as response:
        assert response.status_code == 200
        received = response.iter_bytes()
        raw = next(received).decode()
        serving = [name for name, address in addresses.items() if engine_load(address)[0] == 1]
        assert len(serving) == 1, serving
        victim = platform.engine(serving[0])
        victim.stop(signal.SIGKILL)
        # The rest of the stream must end cleanly (no transport error), the failure its last event.
        raw += b"".join(received).decode()
    events = sse_events(raw)
    assert events[0].startswith('{"id"') and "[DONE]" not in events
    last = json.loads(events[-1])
    assert set(last) == {"error"} and set(last["error"]) == {"message", "type", "param", "code"}
    assert last["error"]["type"] == "service_unavailable", last

    # New requests all go to the survivor (whatever the router's view was at the instant of death).
    survivor = next(name for name in addresses if name != serving[0])
    for _ in range(3):
        done = platform.client().chat.completions.create(
            model=TINY_MODEL_ID, messages=chat(), max_tokens=2, extra_body={"ignore_eos": True}
        )
        assert done.usage.completion_tokens == 2

    # The cache index forgets the dead replica's blocks and shows it disconnected.
    with grpc.insecure_channel(platform.stack.address("cache")) as channel:
        stub = cache_pb2_grpc.CacheIndexServiceStub(channel)
        deadline = time.monotonic() + 15
        while True:
            states = {
                r.address: r for r in stub.ListReplicas(cache_pb2.ListReplicasRequest(), timeout=5).replicas
            }
            dead = states[victim.address]
            if not dead.connected and dead.cached_blocks == 0:
                break
            assert time.monotonic() < deadline, states
            time.sleep(0.1)
        assert states[addresses[survivor]].connected and states[addresses[survivor]].cached_blocks > 0
