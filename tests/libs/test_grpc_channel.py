"""Client channels: which targets spread calls over several servers, and that they reach them."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest
from tls_certs import TestPki

from cachet.config import ServiceSettings
from cachet.grpc_channel import create_channel, list_authority, spreads_calls
from cachet.grpc_server import RunningServer, create_server
from cachet.tls import TlsSettings

SERVICE = "cachet.test.v1.Name"


def _named(name: bytes):
    async def answer(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        return name

    def register(server: grpc.aio.Server) -> None:
        handler = grpc.unary_unary_rpc_method_handler(answer, lambda b: b, lambda b: b)
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, {"Name": handler}),))

    return register


@pytest.mark.parametrize(
    ("address", "spread"),
    [
        ("127.0.0.1:50091", False),
        ("cachet-router:50091", False),
        ("ipv4:127.0.0.1:50091,127.0.0.1:50092", True),
        ("dns:///cachet-router-headless.ai.svc.cluster.local:50091", True),
    ],
)
def test_lists_and_dns_targets_spread_calls_and_one_address_does_not(address: str, spread: bool) -> None:
    assert spreads_calls(address) is spread


@pytest.mark.parametrize(
    ("address", "authority"),
    [
        ("127.0.0.1:50091", None),
        ("ipv4:127.0.0.1:50091", None),
        ("dns:///cachet-router-headless.ai.svc.cluster.local:50091", None),
        ("ipv4:127.0.0.1:50091,127.0.0.1:50092", "127.0.0.1:50091"),
        ("ipv6:[::1]:50091,[::1]:50092", "[::1]:50091"),
    ],
)
def test_an_address_list_is_named_by_its_first_address(address: str, authority: str | None) -> None:
    assert list_authority(address) == authority


async def _reaches_both(servers: list[RunningServer], tls: TlsSettings | None) -> None:
    async with create_channel(f"dns:///localhost:{servers[0].port}", tls=tls) as channel:
        assert await channel.unary_unary(f"/{SERVICE}/Name")(b"", timeout=10) == b"a"
    listed = "ipv4:" + ",".join(f"127.0.0.1:{server.port}" for server in servers)
    answers: set[bytes] = set()
    async with create_channel(listed, tls=tls) as channel:
        # Round robin uses the connections that are up; the second may come up a moment late.
        for _ in range(200):
            answers.add(await channel.unary_unary(f"/{SERVICE}/Name")(b"", timeout=10))
            if len(answers) == 2:
                break
            await asyncio.sleep(0.01)
    assert answers == {b"a", b"b"}


@pytest.mark.parametrize("secured", [False, True], ids=["plaintext", "mtls"])
async def test_a_dns_target_and_an_address_list_reach_their_servers(secured: bool, tmp_path: Path) -> None:
    """Under mutual TLS too: the list's servers are checked against its first address's host
    (127.0.0.1, which the test certificate names), not the whole list."""
    pki = TestPki.create(tmp_path) if secured else None
    settings = ServiceSettings(port=0, tls=pki.server(client_auth=True)) if pki else ServiceSettings(port=0)
    servers = [await create_server(settings, [_named(name)], [SERVICE]) for name in (b"a", b"b")]
    try:
        await _reaches_both(servers, pki.client() if pki else None)
    finally:
        for server in servers:
            await server.stop(grace=None)
