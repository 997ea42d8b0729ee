"""End to end: a real tiny-model engine process, the cache service process following it.

The engine caches a prompt's blocks and publishes them; the cache index must
report the engine holding exactly those blocks, and forget it the moment the
engine is killed with SIGKILL (no goodbye on the stream, just a reset socket).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from cachet.block_hash import block_hashes
from cachet.cache.v1 import cache_pb2, cache_pb2_grpc
from cachet.common.v1 import common_pb2
from cachet.engine.model_runner import ModelRunner
from cachet.engine.v1 import engine_pb2, engine_pb2_grpc
from cachet.grpc_channel import create_channel
from cachet.loopback_port import free_loopback_port
from cachet.models.tiny import write_tiny_model

# 64 tokens: exactly 4 full blocks of 16; ids well inside the tiny model's vocabulary.
PROMPT = list(range(1000, 1064))


def _spawn(module: str, env: dict[str, str], log_path: Path) -> subprocess.Popen:
    # One thread each: the test box has two cores shared by everything.
    base = {**os.environ, "OMP_NUM_THREADS": "1", "CACHET_ENGINE_THREADS": "1", "CACHET_DEVICE": "cpu"}
    with log_path.open("wb") as log_file:
        return subprocess.Popen([sys.executable, "-m", module], env={**base, **env}, stderr=log_file)


def _stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


async def _until(probe: Callable, timeout: float, what: str):
    """Await ``probe()`` until it returns something truthy; return that."""
    deadline = time.monotonic() + timeout
    while not (result := await probe()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        await asyncio.sleep(0.05)
    return result


@pytest.fixture
async def engine_and_cache(tmp_path):
    model_dir = write_tiny_model(tmp_path / "model")
    engine_port, cache_port = free_loopback_port(), free_loopback_port()
    engine_address = f"127.0.0.1:{engine_port}"
    engine = _spawn(
        "cachet.engine",
        {"CACHET_MODEL": str(model_dir), "CACHET_ENGINE_PORT": str(engine_port)},
        tmp_path / "engine.log",
    )
    cache = _spawn(
        "cachet.cache",
        {"CACHET_CACHE_PORT": str(cache_port), "CACHET_CACHE_ENGINE_ADDRESSES": json.dumps([engine_address])},
        tmp_path / "cache.log",
    )
    engine_channel = create_channel(engine_address)
    cache_channel = create_channel(f"127.0.0.1:{cache_port}")
    try:
        yield (
            engine,
            engine_address,
            engine_pb2_grpc.EngineServiceStub(engine_channel),
            cache_pb2_grpc.CacheIndexServiceStub(cache_channel),
        )
    finally:
        await engine_channel.close()
        await cache_channel.close()
        _stop(cache)
        _stop(engine)
        # pytest shows captured output only when the test fails: that is when the logs matter.
        for name in ("engine.log", "cache.log"):
            print(f"--- {name} ---\n{(tmp_path / name).read_text(errors='replace')[-4000:]}")


async def test_the_index_mirrors_a_real_engine_and_forgets_it_when_killed(engine_and_cache) -> None:
    engine, engine_address, engine_stub, cache_stub = engine_and_cache
    info = await engine_stub.GetEngineInfo(
        engine_pb2.GetEngineInfoRequest(), wait_for_ready=True, timeout=120
    )
    chain = block_hashes(
        PROMPT, info.model, block_size=info.block_size, reproducible=info.reproducible_kernels
    )
    assert len(chain) == 64 // info.block_size

    # Nothing is cached before the first request. (Whether the cache subscribed before or after
    # the request does not matter: a late subscription starts with a snapshot of the blocks.)
    match_request = cache_pb2.MatchPrefixRequest(model=info.model, block_hashes=chain)
    reply = await cache_stub.MatchPrefix(match_request, wait_for_ready=True, timeout=60)
    assert list(reply.matches) == []

    generate = engine_pb2.GenerateRequest(
        request_id="cache-e2e-1",
        model=info.model,
        prompt_token_ids=PROMPT,
        sampling=common_pb2.SamplingParams(temperature=0.0, max_tokens=4),
    )
    responses = [response async for response in engine_stub.Generate(generate, timeout=120)]
    assert responses and responses[-1].finish_reason

    async def engine_match() -> list[tuple[str, int]]:
        reply = await cache_stub.MatchPrefix(match_request)
        return [(m.address, m.matched_blocks) for m in reply.matches]

    assert await _until(engine_match, 10, "the prompt's blocks in the index") == [
        (engine_address, len(chain))
    ]
    [state] = (await cache_stub.ListReplicas(cache_pb2.ListReplicasRequest())).replicas
    assert (state.address, state.replica_id, state.connected) == (engine_address, info.replica_id, True)
    # The 4 prompt blocks, plus any block the 4 generated tokens filled (none: 68 < 80 tokens).
    assert state.cached_blocks == len(chain)

    engine.send_signal(signal.SIGKILL)
    engine.wait(10)
    killed_at = time.monotonic()

    async def forgotten() -> bool:
        listed = await cache_stub.ListReplicas(cache_pb2.ListReplicasRequest())
        return [(r.connected, r.cached_blocks) for r in listed.replicas] == [(False, 0)]

    await _until(forgotten, 5, "the killed engine to be forgotten")
    assert time.monotonic() - killed_at < 2.0
    assert await engine_match() == []


async def test_the_index_follows_blocks_into_the_host_and_shared_tiers(tmp_path) -> None:
    """A pool of 5 blocks: a second prompt evicts the first one's blocks, the host tier keeps
    them, and every block reaches the shared folder; the index says so, tier by tier."""
    model_dir = write_tiny_model(tmp_path / "model")
    per_block = ModelRunner(
        model_dir, dtype=torch.float32, device=torch.device("cpu"), kv_cache_bytes=64 << 20
    )._kv_cache_bytes_per_block()
    gib = 1024**3
    engine_port, cache_port = free_loopback_port(), free_loopback_port()
    engine_address = f"127.0.0.1:{engine_port}"
    engine = _spawn(
        "cachet.engine",
        {
            "CACHET_MODEL": str(model_dir),
            "CACHET_ENGINE_PORT": str(engine_port),
            "CACHET_DTYPE": "float32",
            "CACHET_KV_CACHE_GB": str(5 * per_block / gib),
            "CACHET_KV_HOST_GB": str(16 * per_block / gib),
            "CACHET_KV_SHARED_DIR": str(tmp_path / "shared"),
        },
        tmp_path / "engine.log",
    )
    cache = _spawn(
        "cachet.cache",
        {"CACHET_CACHE_PORT": str(cache_port), "CACHET_CACHE_ENGINE_ADDRESSES": json.dumps([engine_address])},
        tmp_path / "cache.log",
    )
    engine_channel = create_channel(engine_address)
    cache_channel = create_channel(f"127.0.0.1:{cache_port}")
    try:
        engine_stub = engine_pb2_grpc.EngineServiceStub(engine_channel)
        cache_stub = cache_pb2_grpc.CacheIndexServiceStub(cache_channel)
        info = await engine_stub.GetEngineInfo(
            engine_pb2.GetEngineInfoRequest(), wait_for_ready=True, timeout=120
        )
        assert info.total_kv_blocks == 5
        first, second = PROMPT, list(range(2000, 2064))
        chains = [
            block_hashes(p, info.model, block_size=info.block_size, reproducible=info.reproducible_kernels)
            for p in (first, second)
        ]

        async def generate(request_id: str, prompt: list[int]) -> None:
            request = engine_pb2.GenerateRequest(
                request_id=request_id,
                model=info.model,
                prompt_token_ids=prompt,
                sampling=common_pb2.SamplingParams(temperature=0.0, max_tokens=4),
            )
            responses = [r async for r in engine_stub.Generate(request, timeout=120)]
            assert responses and responses[-1].finish_reason

        await generate("tiers-1", first)
        await generate("tiers-2", second)

        async def tiers() -> list[list[tuple[int, int, int]]]:
            found = []
            for chain in chains:
                query = cache_pb2.MatchPrefixRequest(model=info.model, block_hashes=chain)
                reply = await cache_stub.MatchPrefix(query, wait_for_ready=True, timeout=30)
                found.append([(m.engine_blocks, m.host_blocks, m.shared_blocks) for m in reply.matches])
            return found

        async def settled() -> list[list[tuple[int, int, int]]] | None:
            found = await tiers()
            listed = await cache_stub.ListReplicas(cache_pb2.ListReplicasRequest())
            shared = [r.shared_blocks for r in listed.replicas]
            return found if found == [[(0, 4, 0)], [(4, 0, 0)]] and shared == [8] else None

        # The second prompt took the whole pool: the first one's blocks are in host memory only.
        await _until(settled, 20, "the first prompt in the host tier, every block in the shared one")
        [state] = (await cache_stub.ListReplicas(cache_pb2.ListReplicasRequest())).replicas
        assert (state.cached_blocks, state.host_blocks, state.shared_blocks) == (4, 4, 8)
    finally:
        await engine_channel.close()
        await cache_channel.close()
        _stop(cache)
        _stop(engine)
        for name in ("engine.log", "cache.log"):
            print(f"--- {name} ---\n{(tmp_path / name).read_text(errors='replace')[-4000:]}")


async def test_a_block_one_replica_wrote_to_the_shared_folder_is_credited_to_every_replica_seeing_it(
    tmp_path,
) -> None:
    """Two engines on one shared folder: the index credits B with the blocks A wrote before B
    has read any of them (they are one folder's files), and B does load them from there."""
    model_dir = write_tiny_model(tmp_path / "model")
    cache_port = free_loopback_port()
    ports = [free_loopback_port(), free_loopback_port()]
    addresses = [f"127.0.0.1:{port}" for port in ports]
    engines = [
        _spawn(
            "cachet.engine",
            {
                "CACHET_MODEL": str(model_dir),
                "CACHET_ENGINE_PORT": str(port),
                "CACHET_DTYPE": "float32",
                "CACHET_KV_CACHE_GB": "0.01",
                "CACHET_KV_HOST_GB": "0.01",
                "CACHET_KV_SHARED_DIR": str(tmp_path / "shared"),
            },
            tmp_path / f"engine-{index}.log",
        )
        for index, port in enumerate(ports)
    ]
    cache = _spawn(
        "cachet.cache",
        {"CACHET_CACHE_PORT": str(cache_port), "CACHET_CACHE_ENGINE_ADDRESSES": json.dumps(addresses)},
        tmp_path / "cache.log",
    )
    channels = [create_channel(address) for address in addresses]
    cache_channel = create_channel(f"127.0.0.1:{cache_port}")
    try:
        stubs = [engine_pb2_grpc.EngineServiceStub(channel) for channel in channels]
        cache_stub = cache_pb2_grpc.CacheIndexServiceStub(cache_channel)
        info = await stubs[0].GetEngineInfo(
            engine_pb2.GetEngineInfoRequest(), wait_for_ready=True, timeout=120
        )
        await stubs[1].GetEngineInfo(engine_pb2.GetEngineInfoRequest(), wait_for_ready=True, timeout=120)
        chain = block_hashes(
            PROMPT, info.model, block_size=info.block_size, reproducible=info.reproducible_kernels
        )

        async def generate(stub, request_id: str) -> int:
            request = engine_pb2.GenerateRequest(
                request_id=request_id,
                model=info.model,
                prompt_token_ids=PROMPT,
                sampling=common_pb2.SamplingParams(temperature=0.0, max_tokens=4),
            )
            responses = [r async for r in stub.Generate(request, timeout=120)]
            return responses[-1].usage.cached_tokens

        assert await generate(stubs[0], "written-by-a") == 0

        async def credited() -> dict[str, tuple[int, int, int]] | None:
            query = cache_pb2.MatchPrefixRequest(model=info.model, block_hashes=chain)
            reply = await cache_stub.MatchPrefix(query, wait_for_ready=True, timeout=30)
            found = {m.address: (m.engine_blocks, m.host_blocks, m.shared_blocks) for m in reply.matches}
            last_seen.append(found)
            return found if found == {addresses[0]: (4, 0, 0), addresses[1]: (0, 0, 4)} else None

        last_seen: list[dict[str, tuple[int, int, int]]] = []
        try:
            await _until(credited, 20, "B credited with the blocks A wrote to the shared folder")
        finally:
            print("index's last answer:", last_seen[-1:] or None)
        # The prompt's last token is always computed: B loads 3 of the 4 blocks from the folder.
        assert await generate(stubs[1], "read-by-b") == 48
    finally:
        for channel in [*channels, cache_channel]:
            await channel.close()
        _stop(cache)
        for engine in engines:
            _stop(engine)
        for name in ("engine-0.log", "engine-1.log", "cache.log"):
            print(f"--- {name} ---\n{(tmp_path / name).read_text(errors='replace')[-4000:]}")
