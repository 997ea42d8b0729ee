"""CacheIndexService over real gRPC: validation, watching, listing, matching, metrics, the process."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import urllib.request

import grpc
import pytest
from scripted_kv_events import MODEL, batch, eventually, removed, stored

from cachet.block_hash import block_hashes
from cachet.cache.main import start
from cachet.cache.servicer import parse_loopback_address
from cachet.cache.settings import CacheSettings
from cachet.cache.v1 import cache_pb2, cache_pb2_grpc
from cachet.errors import error_info_from_metadata
from cachet.grpc_channel import create_channel
from cachet.loopback_port import free_loopback_port

CHAIN = block_hashes(list(range(4 * 16)), MODEL)


@pytest.fixture
async def cache():
    running = await start(CacheSettings(port=0), metrics_port=0)
    channel = create_channel(running.address)
    yield running, cache_pb2_grpc.CacheIndexServiceStub(channel)
    await channel.close()
    await running.stop(grace=None)


async def _status_of(call) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.aio.AioRpcError) as failure:
        await call
    return failure.value.code(), error_info_from_metadata(failure.value.trailing_metadata()).param


async def test_match_prefix_rejects_an_empty_model_or_chain(cache) -> None:
    _, stub = cache
    no_model = stub.MatchPrefix(cache_pb2.MatchPrefixRequest(model="", block_hashes=CHAIN))
    assert await _status_of(no_model) == (grpc.StatusCode.INVALID_ARGUMENT, "model")
    no_hashes = stub.MatchPrefix(cache_pb2.MatchPrefixRequest(model=MODEL))
    assert await _status_of(no_hashes) == (grpc.StatusCode.INVALID_ARGUMENT, "block_hashes")


@pytest.mark.parametrize(
    "address",
    [
        "",
        "127.0.0.1",
        "127.0.0.1:",
        "127.0.0.1:http",
        "127.0.0.1:0",
        "127.0.0.1:65536",
        "10.0.0.7:50061",
        "example.com:50061",
        "0.0.0.0:50061",
        "[2001:db8::1]:50061",
        "127.0.0.1:50061/x",
        "::1:50061",
        "127.0.0.1:５０",
    ],
)
async def test_watch_replica_rejects_malformed_and_remote_addresses(cache, address: str) -> None:
    _, stub = cache
    call = stub.WatchReplica(cache_pb2.WatchReplicaRequest(address=address))
    assert await _status_of(call) == (grpc.StatusCode.INVALID_ARGUMENT, "address")


@pytest.mark.parametrize("address", ["127.0.0.1:50061", "localhost:1", "[::1]:50061", "127.3.4.5:65535"])
def test_loopback_addresses_are_accepted(address: str) -> None:
    assert parse_loopback_address(address) == address


async def test_watch_list_and_match_a_followed_replica(cache, scripted) -> None:
    running, stub = cache
    servicer, engine = scripted
    assert (await stub.ListReplicas(cache_pb2.ListReplicasRequest())).replicas == []

    assert (await stub.WatchReplica(cache_pb2.WatchReplicaRequest(address=engine.address))).added
    assert not (await stub.WatchReplica(cache_pb2.WatchReplicaRequest(address=engine.address))).added
    await eventually(lambda: servicer.subscriptions == 1)
    servicer.send(batch(0, stored(CHAIN[:3])), batch(1, stored([CHAIN[3]], parent=CHAIN[2])))
    await eventually(lambda: running.index.replica_blocks(engine.address) == 4)

    listed = await stub.ListReplicas(cache_pb2.ListReplicasRequest())
    assert listed == cache_pb2.ListReplicasResponse(
        replicas=[
            cache_pb2.ReplicaState(
                address=engine.address,
                replica_id="replica-1",
                connected=True,
                cached_blocks=4,
                last_sequence_number=1,
            )
        ]
    )
    reply = await stub.MatchPrefix(cache_pb2.MatchPrefixRequest(model=MODEL, block_hashes=CHAIN))
    assert [(m.address, m.matched_blocks, m.engine_blocks) for m in reply.matches] == [(engine.address, 4, 4)]
    other_model = await stub.MatchPrefix(cache_pb2.MatchPrefixRequest(model="other", block_hashes=CHAIN))
    assert list(other_model.matches) == []

    # A dead engine is listed as disconnected with nothing cached, and matches nothing.
    await engine.server.stop(grace=None)
    await eventually(lambda: running.index.replicas() == [])
    listed = await stub.ListReplicas(cache_pb2.ListReplicasRequest())
    assert (listed.replicas[0].connected, listed.replicas[0].cached_blocks) == (False, 0)
    assert listed.replicas[0].replica_id == ""
    reply = await stub.MatchPrefix(cache_pb2.MatchPrefixRequest(model=MODEL, block_hashes=CHAIN))
    assert list(reply.matches) == []


def _scrape(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        lines = response.read().decode().splitlines()
    return {
        name: float(value)
        for name, _, value in (line.partition(" ") for line in lines if line.startswith("cachet_cache_"))
    }


async def test_metrics_report_the_index_figures(cache, scripted) -> None:
    running, stub = cache
    servicer, engine = scripted
    await stub.WatchReplica(cache_pb2.WatchReplicaRequest(address=engine.address))
    await eventually(lambda: servicer.subscriptions == 1)
    servicer.send(batch(0, stored(CHAIN[:3])))
    await eventually(lambda: running.index.replica_blocks(engine.address) == 3)
    await stub.MatchPrefix(cache_pb2.MatchPrefixRequest(model=MODEL, block_hashes=CHAIN))
    await stub.MatchPrefix(cache_pb2.MatchPrefixRequest(model=MODEL, block_hashes=CHAIN[:2]))

    figures = await asyncio.to_thread(_scrape, running.metrics_port)
    assert figures['cachet_cache_index_blocks{tier="engine"}'] == 3
    assert figures['cachet_cache_index_blocks{tier="host"}'] == 0
    assert figures["cachet_cache_index_lookups_total"] == 2
    hit = f'cachet_cache_index_hit_blocks_total{{replica="{engine.address}",tier='
    assert figures[hit + '"engine"}'] == 3 + 2
    # The pool loses blocks 1 and 2 and the host tier keeps them; the shared tier holds block 3.
    servicer.send(
        batch(1, removed(CHAIN[1:3]), stored(CHAIN[1:3], tier="host"), stored([CHAIN[3]], tier="shared"))
    )
    await eventually(lambda: running.index.replica_blocks(engine.address, "host") == 2)
    reply = await stub.MatchPrefix(cache_pb2.MatchPrefixRequest(model=MODEL, block_hashes=CHAIN))
    assert [(m.matched_blocks, m.engine_blocks, m.host_blocks, m.shared_blocks) for m in reply.matches] == [
        (4, 1, 2, 1)
    ]
    figures = await asyncio.to_thread(_scrape, running.metrics_port)
    assert figures['cachet_cache_index_blocks{tier="engine"}'] == 1
    assert figures['cachet_cache_index_blocks{tier="host"}'] == 2
    assert figures['cachet_cache_index_blocks{tier="shared"}'] == 1
    assert figures[hit + '"engine"}'] == 3 + 2 + 1
    assert figures[hit + '"host"}'] == 2
    assert figures[hit + '"shared"}'] == 1
    listed = await stub.ListReplicas(cache_pb2.ListReplicasRequest())
    state = listed.replicas[0]
    assert (state.cached_blocks, state.host_blocks, state.shared_blocks) == (1, 2, 1)
    # The same hits, and the blocks the three lookups asked for, in the replica's state.
    assert (state.engine_hit_blocks, state.host_hit_blocks, state.shared_hit_blocks) == (3 + 2 + 1, 2, 1)
    assert state.queried_blocks == 2 * len(CHAIN) + 2
    assert figures["cachet_cache_index_replicas_connected"] == 1


async def test_the_process_follows_configured_engines_and_stops_on_sigterm(scripted, tmp_path) -> None:
    servicer, engine = scripted
    port = free_loopback_port()
    env = {
        **os.environ,
        "CACHET_CACHE_PORT": str(port),
        "CACHET_CACHE_ENGINE_ADDRESSES": json.dumps([engine.address]),
    }
    log_path = tmp_path / "cache.log"
    # Logs go to a file, not a pipe nobody drains (a full pipe would stall the process).
    with log_path.open("wb") as log_file:
        process = subprocess.Popen([sys.executable, "-m", "cachet.cache"], env=env, stderr=log_file)
    try:
        await eventually(lambda: servicer.subscriptions == 1, timeout=30, what="the process to subscribe")
        servicer.send(batch(0, stored(CHAIN)))
        async with create_channel(f"127.0.0.1:{port}") as channel:
            stub = cache_pb2_grpc.CacheIndexServiceStub(channel)
            request = cache_pb2.MatchPrefixRequest(model=MODEL, block_hashes=CHAIN)
            for _ in range(500):
                reply = await stub.MatchPrefix(request, wait_for_ready=True, timeout=10)
                if reply.matches:
                    break
                await asyncio.sleep(0.01)
            assert [(m.address, m.matched_blocks) for m in reply.matches] == [(engine.address, 4)]
        process.send_signal(signal.SIGTERM)
        assert await asyncio.to_thread(process.wait, 15) == 0, log_path.read_text()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
