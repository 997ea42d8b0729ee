"""One bridge in front of two routers under mutual TLS: real processes, the routers sharing one
PostgreSQL store, the bridge's router address an ``ipv4:a,b`` list spread round robin.

gRPC checks every server of a list against one name (``grpc_channel.list_authority``: the first
address's host, 127.0.0.1, which the test certificate names); the bridge's requests are served
by both routers, as each router's /metrics (HTTPS, scraped with a client certificate) counts.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest
from metrics_scrape import growth, scrape
from postgres_schemas import SessionSchemas
from service_processes import (
    ENGINE_SERVER_BUILT,
    TINY_MODEL_ID,
    ServiceProcess,
    free_port,
    launch_service,
    start_service,
)
from tls_certs import TestPki

from cachet.models.tiny import write_tiny_model
from cachet.tls import http_client_context

from .test_tls import wait_https_health

KEYS = {"sk-two": "acct-two"}


@dataclass
class Deployment:
    pki: TestPki
    routers: tuple[ServiceProcess, ServiceProcess]
    bridge: ServiceProcess


@pytest.fixture(scope="module")
def deployment(
    tmp_path_factory: pytest.TempPathFactory, postgres_schemas: SessionSchemas
) -> Iterator[Deployment]:
    if not ENGINE_SERVER_BUILT:
        pytest.skip("the engine server (cachet.engine.main) is not built yet")
    url = postgres_schemas.create_now()
    root = tmp_path_factory.mktemp("tls-two-routers")
    pki = TestPki.create(root / "pki")
    mtls = pki.env(client_auth=True)
    model_dir = write_tiny_model(root / TINY_MODEL_ID)
    started: list[ServiceProcess] = []
    try:
        tokenizer = start_service(
            "tokenizer", {"CACHET_TOKENIZER_MODELS": json.dumps([str(model_dir)])} | mtls, root
        )
        started.append(tokenizer)
        usage = start_service("usage", {"CACHET_STORE_URL": url} | mtls, root)
        started.append(usage)
        engine = start_service("engine", {"CACHET_MODEL": str(model_dir)} | mtls, root, timeout=300)
        started.append(engine)
        # One engine: the routers place without asking a cache index (none runs).
        router_env = {
            "CACHET_ROUTER_TOKENIZER_ADDRESS": tokenizer.address,
            "CACHET_ROUTER_USAGE_ADDRESS": usage.address,
            "CACHET_ROUTER_ENGINE_ADDRESSES": json.dumps([engine.address]),
            "CACHET_STORE_URL": url,
            "CACHET_DATA_DIR": str(root / "router"),
            "CACHET_API_KEYS": json.dumps(KEYS),
        } | mtls
        routers = tuple(
            start_service("router", router_env, root, name=name) for name in ("router-a", "router-b")
        )
        started.extend(routers)
        port = free_port()
        listed = "ipv4:" + ",".join(router.address for router in routers)
        bridge = launch_service(
            "bridge",
            {
                "CACHET_PORT": str(port),
                "CACHET_BRIDGE_ROUTER_ADDRESS": listed,
                "CACHET_BRIDGE_USAGE_ADDRESS": usage.address,
                "CACHET_BRIDGE_TOKENIZER_ADDRESS": tokenizer.address,
                "CACHET_API_KEYS": json.dumps(KEYS),
            }
            | pki.env(client_auth=False),
            root,
            port=port,
        )
        started.append(bridge)
        wait_https_health(bridge, http_client_context(pki.client(None)))
        yield Deployment(pki, (routers[0], routers[1]), bridge)
    finally:
        for process in reversed(started):
            process.stop()
        print("\n".join(f"--- {p.name} ---\n{p.log_tail()}" for p in started))
        postgres_schemas.drop_now(url)


def _served(before: dict, after: dict) -> float:
    return growth(before, after)("cachet_router_requests_total", outcome="ok")


def test_the_bridge_spreads_requests_over_both_routers_under_mtls(deployment: Deployment) -> None:
    tls = deployment.pki.client()
    before = [scrape(router.metrics_port, "cachet_router_", tls) for router in deployment.routers]
    body = {
        "model": TINY_MODEL_ID,
        "messages": [{"role": "user", "content": "Two routers, one bridge."}],
        "max_tokens": 1,
    }
    context = http_client_context(deployment.pki.client(None))
    url = f"https://{deployment.bridge.address}"
    with httpx.Client(base_url=url, verify=context, timeout=60) as client:
        headers = {"Authorization": "Bearer sk-two"}
        answers = [client.post("/v1/chat/completions", headers=headers, json=body) for _ in range(8)]
    assert [answer.status_code for answer in answers] == [200] * 8, answers[0].text
    after = [scrape(router.metrics_port, "cachet_router_", tls) for router in deployment.routers]
    served = [_served(b, a) for b, a in zip(before, after, strict=True)]
    assert sum(served) == 8
    assert all(count > 0 for count in served), f"one router served every request: {served}"
