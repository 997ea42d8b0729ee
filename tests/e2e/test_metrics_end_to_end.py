"""Every service's /metrics during an end-to-end run: each answers, each counted the requests that
went through it, and every name follows Prometheus's conventions.

Real processes (tests/service_processes.py gives each gRPC service a /metrics port; the bridge
serves /metrics on its REST port), one engine on the tiny model.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from metrics_scrape import exported_names, exposition, naming_problems, scrape
from service_processes import ENGINE_SERVER_BUILT, TINY_MODEL_ID, CachetStack, ServiceProcess

from cachet.models.tiny import write_tiny_model

SERVICES = ("tokenizer", "usage", "engine0", "cache", "router", "bridge")
DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "cachet-dashboard.json"


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[CachetStack, ServiceProcess]]:
    if not ENGINE_SERVER_BUILT:
        pytest.skip("the engine server (cachet.engine.main) is not built yet")
    root = tmp_path_factory.mktemp("metrics-e2e")
    stack = CachetStack(root, write_tiny_model(root / TINY_MODEL_ID)).start(engines=1)
    try:
        yield stack, stack.start_bridge()
    finally:
        stack.stop()


def _chat(bridge: ServiceProcess, system: str) -> dict:
    body = {
        "model": TINY_MODEL_ID,
        "messages": [
            {"role": "system", "content": system},
            {"role": "user", "content": "What is the capital of France?"},
        ],
        "max_tokens": 4,
        "temperature": 0,
    }
    answer = httpx.post(f"http://{bridge.address}/v1/chat/completions", json=body, timeout=120)
    assert answer.status_code == 200, answer.text
    return answer.json()["usage"]


def _value(figures: dict, name: str, **labels: str) -> float:
    return sum(
        value
        for (sample, sample_labels), value in figures.items()
        if sample == name and set(labels.items()) <= set(sample_labels)
    )


def test_every_service_exports_what_a_request_did_under_conventional_names(stack) -> None:
    stack, bridge = stack
    # Long enough for whole 16-token blocks, so the second request is served from the cache.
    system = f"[{uuid.uuid4().hex}] You are a terse assistant. Answer in one short sentence, no more."
    _chat(bridge, system)
    usage = _chat(bridge, system)
    assert usage["prompt_tokens_details"]["cached_tokens"] > 0

    processes = {**stack.processes, "bridge": bridge}
    # The router sends usage records in batches after the answer: wait for both.
    deadline = time.monotonic() + 30
    while _value(scrape(processes["usage"].metrics_port), "cachet_usage_records_total") < 2:
        assert time.monotonic() < deadline, stack.logs()
        time.sleep(0.1)
    texts = {name: exposition(processes[name].metrics_port) for name in SERVICES}
    for name, text in texts.items():
        assert naming_problems(text) == [], name
    figures = {name: scrape(processes[name].metrics_port) for name in SERVICES}

    # Every gRPC service counts the calls it answered, by method and code.
    handled = "cachet_grpc_server_handled_total"
    assert _value(figures["tokenizer"], handled, grpc_code="OK") >= 2
    assert _value(figures["usage"], handled, grpc_method="RecordUsageBatch", grpc_code="OK") >= 1
    assert _value(figures["engine0"], handled, grpc_method="Generate", grpc_code="OK") >= 2
    # (One replica: the router asks the index nothing, the index follows the engine's KV events.)
    assert _value(figures["engine0"], "cachet_grpc_server_started_total", grpc_method="StreamKvEvents") >= 1
    # ...and its own figures, read where the work happened.
    assert _value(figures["usage"], "cachet_usage_records_total", model=TINY_MODEL_ID) >= 2
    assert _value(figures["usage"], "cachet_usage_tokens_total", kind="cached") > 0
    assert _value(figures["engine0"], "cachet_engine_steps_total") > 0
    assert _value(figures["cache"], "cachet_cache_index_replicas_connected") == 1
    assert _value(figures["cache"], "cachet_cache_index_blocks", tier="engine") > 0
    assert _value(figures["router"], "cachet_router_cached_tokens_total") > 0
    assert _value(figures["router"], "cachet_router_time_per_output_token_seconds_count") >= 1
    assert _value(figures["bridge"], "cachet_bridge_requests_total", route="/v1/chat/completions") >= 2
    # The process's own figures come with every gRPC service's endpoint.
    for name in SERVICES[:-1]:
        assert "process_resident_memory_bytes" in texts[name], name

    # Every series the Grafana dashboard (deploy/grafana) plots is one some service exports.
    exported = set().union(*(exported_names(text) for text in texts.values()))
    queries = [
        target["expr"] for panel in json.loads(DASHBOARD.read_text())["panels"] for target in panel["targets"]
    ]
    plotted = {name for query in queries for name in re.findall(r"\bcachet_[a-z0-9_]+", query)}
    assert plotted and plotted <= exported, plotted - exported
