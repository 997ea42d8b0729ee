"""TLS across real processes: the bridge over HTTPS, every gRPC hop and the router's API over mutual TLS.

The tokenizer, usage service, engine, cache index and router require client certificates from
the test CA; the bridge serves HTTPS with the same certificate and presents it when it calls
them. The bridge's /health (the router's gRPC health), /v1/usage (the usage service) and
count_tokens (the tokenizer) each cross one mutual-TLS hop; a chat completion crosses them all
(the router to the tokenizer, the cache index, the engine and usage; the cache index follows the
engine's KV events); the router's own API is called directly, with the API key in metadata as
REST sends it in headers.
"""

from __future__ import annotations

import json
import ssl
import time
from collections.abc import Iterator
from dataclasses import dataclass

import grpc
import httpx
import pytest
from service_processes import TINY_MODEL_ID, ServiceProcess, free_port, launch_service, start_service
from tls_certs import TestPki

from cachet.cache.v1 import cache_pb2, cache_pb2_grpc
from cachet.grpc_channel import create_channel
from cachet.models.tiny import write_tiny_model
from cachet.router.v1 import router_pb2, router_pb2_grpc
from cachet.tls import blocking_channel, http_client_context

KEYS = {"sk-tls": "acct-tls"}


@dataclass
class Deployment:
    pki: TestPki
    router: ServiceProcess
    bridge: ServiceProcess
    cache: ServiceProcess

    def https(self) -> httpx.Client:
        context = http_client_context(self.pki.client(None))
        return httpx.Client(base_url=f"https://{self.bridge.address}", verify=context, timeout=10)


def _replicas(stub: cache_pb2_grpc.CacheIndexServiceStub) -> list[cache_pb2.ReplicaState]:
    return list(stub.ListReplicas(cache_pb2.ListReplicasRequest(), timeout=5).replicas)


def wait_https_health(bridge: ServiceProcess, verify: ssl.SSLContext, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert bridge.process.poll() is None, bridge.log_tail()
        try:
            if httpx.get(f"https://{bridge.address}/health", verify=verify, timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    pytest.fail(f"bridge not healthy over HTTPS after {timeout} s:\n{bridge.log_tail()}")


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    root = tmp_path_factory.mktemp("tls")
    pki = TestPki.create(root / "pki")
    mtls = pki.env(client_auth=True)
    model_dir = write_tiny_model(root / TINY_MODEL_ID)
    started: list[ServiceProcess] = []
    try:
        tokenizer = start_service(
            "tokenizer", {"CACHET_TOKENIZER_MODELS": json.dumps([str(model_dir)])} | mtls, root
        )
        started.append(tokenizer)
        usage = start_service("usage", {"CACHET_DATA_DIR": str(root / "usage")} | mtls, root)
        started.append(usage)
        engine = start_service("engine", {"CACHET_MODEL": str(model_dir)} | mtls, root, timeout=300)
        started.append(engine)
        cache = start_service(
            "cache", {"CACHET_CACHE_ENGINE_ADDRESSES": json.dumps([engine.address])} | mtls, root
        )
        started.append(cache)
        router = start_service(
            "router",
            {
                "CACHET_ROUTER_TOKENIZER_ADDRESS": tokenizer.address,
                "CACHET_ROUTER_USAGE_ADDRESS": usage.address,
                "CACHET_ROUTER_CACHE_ADDRESS": cache.address,
                "CACHET_ROUTER_ENGINE_ADDRESSES": json.dumps([engine.address]),
                "CACHET_DATA_DIR": str(root / "router"),
                "CACHET_API_KEYS": json.dumps(KEYS),
            }
            | mtls,
            root,
        )
        started.append(router)
        port = free_port()
        bridge = launch_service(
            "bridge",
            {
                "CACHET_PORT": str(port),
                "CACHET_BRIDGE_ROUTER_ADDRESS": router.address,
                "CACHET_BRIDGE_USAGE_ADDRESS": usage.address,
                "CACHET_BRIDGE_TOKENIZER_ADDRESS": tokenizer.address,
                "CACHET_API_KEYS": json.dumps(KEYS),
            }
            # The REST port asks no client certificate; the bridge's calls present one.
            | pki.env(client_auth=False),
            root,
            port=port,
        )
        started.append(bridge)
        wait_https_health(bridge, http_client_context(pki.client(None)))
        yield Deployment(pki, router, bridge, cache)
    finally:
        for process in reversed(started):
            process.stop()


def test_the_bridge_serves_https_that_the_ca_verifies_and_calls_every_backend_over_mtls(
    deployment: Deployment,
) -> None:
    headers = {"Authorization": "Bearer sk-tls"}
    with deployment.https() as client:
        assert client.get("/health").status_code == 200
        usage = client.get("/v1/usage", headers=headers)
        assert usage.status_code == 200, usage.text
        counted = client.post(
            "/v1/messages/count_tokens",
            headers=headers,
            json={"model": TINY_MODEL_ID, "messages": [{"role": "user", "content": "Hello there"}]},
        )
        assert counted.status_code == 200, counted.text
        assert counted.json()["input_tokens"] > 0
        assert client.get("/v1/usage").status_code == 401
        # Twice the same prompt: the second is served from the engine's cache (usage says so).
        body = {
            "model": TINY_MODEL_ID,
            "messages": [{"role": "user", "content": "Tell me about TLS in one long sentence " * 4}],
            "max_tokens": 4,
            "temperature": 0,
        }
        answers = [
            client.post("/v1/chat/completions", headers=headers, json=body, timeout=60) for _ in range(2)
        ]
        assert [answer.status_code for answer in answers] == [200, 200], answers[0].text
        assert answers[1].json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    # The cache index follows the engine's KV events over mutual TLS too.
    with blocking_channel(deployment.cache.address, deployment.pki.client()) as channel:
        stub = cache_pb2_grpc.CacheIndexServiceStub(channel)
        deadline = time.monotonic() + 10
        while not any(r.connected and r.cached_blocks for r in _replicas(stub)):
            assert time.monotonic() < deadline, list(_replicas(stub))
            time.sleep(0.1)
    # Plain HTTP to the same port gets no answer, and a client without the CA refuses the server.
    with pytest.raises(httpx.TransportError):
        httpx.get(f"http://{deployment.bridge.address}/health", timeout=5)
    with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
        httpx.get(
            f"https://{deployment.bridge.address}/health", verify=ssl.create_default_context(), timeout=5
        )


@pytest.mark.parametrize(
    "metadata",
    [(("x-api-key", "sk-tls"),), (("authorization", "Bearer sk-tls"),)],
    ids=["x-api-key", "bearer"],
)
async def test_the_routers_api_over_mtls_takes_the_key_in_metadata(
    deployment: Deployment, metadata: tuple[tuple[str, str], ...]
) -> None:
    async with create_channel(deployment.router.address, tls=deployment.pki.client()) as channel:
        stub = router_pb2_grpc.InferenceServiceStub(channel)
        identity = await stub.Authenticate(router_pb2.AuthenticateRequest(), metadata=metadata, timeout=10)
        assert identity.account_id == "acct-tls"
        for wrong in ((), (("x-api-key", "sk-other"),)):
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stub.Authenticate(router_pb2.AuthenticateRequest(), metadata=wrong, timeout=10)
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED


async def test_the_router_refuses_a_client_without_a_certificate(deployment: Deployment) -> None:
    for tls in (deployment.pki.client(None), None):
        async with create_channel(deployment.router.address, tls=tls) as channel:
            stub = router_pb2_grpc.InferenceServiceStub(channel)
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stub.Authenticate(
                    router_pb2.AuthenticateRequest(), metadata=(("x-api-key", "sk-tls"),), timeout=5
                )
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
