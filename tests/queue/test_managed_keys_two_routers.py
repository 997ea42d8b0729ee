"""Managed keys with two real routers on one PostgreSQL store, through the public gRPC API: a key
made by `cachet keys` works on both, its requests a minute are one count across them, and a
revoke reaches both."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass

import grpc
import pytest
from postgres_schemas import SessionSchemas
from queued_batches import chat
from service_processes import ENGINE_SERVER_BUILT, TINY_MODEL_ID, CachetStack

from cachet.errors import error_info_from_metadata
from cachet.grpc_channel import create_channel
from cachet.models.tiny import write_tiny_model
from cachet.router.v1 import router_pb2, router_pb2_grpc


@dataclass
class Deployment:
    stack: CachetStack
    store_url: str

    def keys(self, *args: str) -> str:
        env = os.environ | {"CACHET_STORE_URL": self.store_url}
        done = subprocess.run(
            [sys.executable, "-m", "cachet.tools.cli", "keys", *args],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert done.returncode == 0, done.stderr
        return done.stdout

    @property
    def router_addresses(self) -> list[str]:
        return [self.stack.address("router"), self.stack.address("router-b")]


@pytest.fixture(scope="module")
def deployment(
    tmp_path_factory: pytest.TempPathFactory, postgres_schemas: SessionSchemas
) -> Iterator[Deployment]:
    if not ENGINE_SERVER_BUILT:
        pytest.skip("the engine server (cachet.engine.main) is not built yet")
    url = postgres_schemas.create_now()
    root = tmp_path_factory.mktemp("keys-two-routers")
    router_env = {
        "CACHET_API_KEYS": json.dumps({"sk-boot": "ops"}),
        "CACHET_STORE_URL": url,
        "CACHET_ROUTER_API_KEY_CACHE_SECONDS": "0",
    }
    stack = CachetStack(root, write_tiny_model(root / TINY_MODEL_ID))
    try:
        stack.start(engines=1, router_env=router_env, usage_env={"CACHET_STORE_URL": url})
        stack.processes["router-b"] = stack.start_router(name="router-b", **router_env)
        yield Deployment(stack, url)
    finally:
        stack.stop()
        print(stack.logs())
        postgres_schemas.drop_now(url)


async def test_a_key_s_limit_and_revoke_hold_across_routers(deployment: Deployment) -> None:
    made = json.loads(deployment.keys("create", "--account", "acct-two", "--rpm", "3", "--json"))
    metadata = (("authorization", f"Bearer {made['key']}"),)
    async with (
        create_channel(deployment.router_addresses[0]) as first,
        create_channel(deployment.router_addresses[1]) as second,
    ):
        stubs = [router_pb2_grpc.InferenceServiceStub(first), router_pb2_grpc.InferenceServiceStub(second)]
        for stub in stubs:
            identity = await stub.Authenticate(
                router_pb2.AuthenticateRequest(), metadata=metadata, timeout=10
            )
            assert (identity.account_id, identity.api_key_id) == ("acct-two", made["key_id"])
        # Three calls spread over both routers spend the key's minute; the fourth is refused by either.
        for n in range(3):
            answer = await stubs[n % 2].CreateChatCompletion(chat(), metadata=metadata, timeout=60)
            assert answer.usage.completion_tokens > 0
        for stub in stubs:
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stub.CreateChatCompletion(chat(), metadata=metadata, timeout=60)
            assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            info = error_info_from_metadata(refused.value.trailing_metadata())
            assert info.type == "requests" and info.rate_limits.limit_requests == 3
            assert info.rate_limits.remaining_requests == 0 and info.retry_after_seconds >= 1

        deployment.keys("revoke", made["key_id"])
        for stub in stubs:
            with pytest.raises(grpc.aio.AioRpcError) as unknown:
                await stub.Authenticate(router_pb2.AuthenticateRequest(), metadata=metadata, timeout=10)
            assert unknown.value.code() == grpc.StatusCode.UNAUTHENTICATED
