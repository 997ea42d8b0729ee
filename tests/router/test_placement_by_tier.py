"""Placement over the real cache index: two scripted engines publish KV events that name their
tiers, the cache service follows them over gRPC, and the router's own query of the index
(``RequestPipeline._cached_prefix_tokens``) feeds ``choose_replica``. A replica holding the
prompt in host memory wins over one holding nothing; one holding it in its pool wins over
the host tier."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from cachet.block_hash import block_hashes
from cachet.cache.main import start
from cachet.cache.settings import CacheSettings
from cachet.cache.v1 import cache_pb2, cache_pb2_grpc
from cachet.config import ServiceSettings
from cachet.engine.v1 import engine_pb2, engine_pb2_grpc
from cachet.grpc_channel import create_channel
from cachet.grpc_server import create_server
from cachet.router.placement import PlacementPolicy, ReplicaLoad, choose_replica
from cachet.router.replica_set import ReplicaSet
from cachet.router.request_pipeline import RequestPipeline

MODEL = "tiny-llama"
PROMPT = list(range(100, 100 + 8 * 16))
CHAIN = block_hashes(PROMPT, MODEL)


class OneBatchEngine(engine_pb2_grpc.EngineServiceServicer):
    """Publishes one snapshot batch of KV events, then holds the stream open."""

    def __init__(self, events: list[engine_pb2.KvEvent]) -> None:
        self.events = events

    async def StreamKvEvents(self, request, context):
        yield engine_pb2.KvEventBatch(
            replica_id="r", sequence_number=0, events=self.events, model=MODEL, block_size=16
        )
        await asyncio.Event().wait()


def stored(hashes: list[int], tier: int) -> engine_pb2.KvEvent:
    return engine_pb2.KvEvent(stored=engine_pb2.BlocksStored(block_hashes=hashes), tier=tier)


async def start_engine(events: list[engine_pb2.KvEvent]):
    servicer = OneBatchEngine(events)

    def register(server: grpc.aio.Server) -> None:
        engine_pb2_grpc.add_EngineServiceServicer_to_server(servicer, server)

    return await create_server(ServiceSettings(port=0), [register], ["cachet.engine.v1.EngineService"])


@pytest.fixture
async def placed_by_index():
    """(engines' addresses, a function that places the prompt with the router's own index query)."""
    engines = [
        await start_engine([]),  # holds nothing
        await start_engine([stored(CHAIN, engine_pb2.KV_TIER_HOST)]),  # the prompt in host memory
        await start_engine(
            [stored(CHAIN, engine_pb2.KV_TIER_ENGINE), stored(CHAIN, engine_pb2.KV_TIER_SHARED)]
        ),  # the prompt in its pool
    ]
    addresses = [engine.address for engine in engines]
    cache = await start(CacheSettings(port=0, engine_addresses=addresses), metrics_port=0)
    channel = create_channel(cache.address)
    stub = cache_pb2_grpc.CacheIndexServiceStub(channel)
    pipeline = RequestPipeline(None, None, None, stub, None, PlacementPolicy(), 5.0)  # type: ignore[arg-type]
    info = engine_pb2.EngineInfo(model=MODEL, block_size=16)

    async def place(among: list[str]) -> str:
        cached = await pipeline._cached_prefix_tokens(info, PROMPT, "")
        return choose_replica([ReplicaLoad(a, 0, 0, 8, 8) for a in among], cached).address

    deadline = time.monotonic() + 10
    while True:
        listed = await stub.ListReplicas(cache_pb2.ListReplicasRequest())
        if sum(r.connected for r in listed.replicas) == 3:
            break
        assert time.monotonic() < deadline, "the cache service never followed the three engines"
        await asyncio.sleep(0.02)
    yield addresses, place, lambda: pipeline._cached_prefix_tokens(info, PROMPT, "")
    await channel.close()
    await cache.stop(grace=None)
    for engine in engines:
        await engine.stop(grace=None)


async def test_host_tier_beats_nothing_and_the_pool_beats_the_host_tier(placed_by_index) -> None:
    (nothing, host, pool), place, cached_tokens = placed_by_index
    # The router's view: 128 prompt tokens, the pool's worth 1 each, the host tier's 0.98.
    cached = await cached_tokens()
    assert cached == {host: pytest.approx(0.98 * 128), pool: 128}
    # Listed both ways round, so neither address order nor list order decides.
    assert await place([nothing, host]) == host
    assert await place([host, nothing]) == host
    assert await place([host, pool]) == pool
    assert await place([pool, host, nothing]) == pool


async def test_a_greedy_prompt_is_matched_on_each_kind_of_host() -> None:
    # Greedy requests' blocks are named by the kernels that computed them (reproducible_kernels):
    # two replicas on hosts of two kinds hold the same prompt under two chains. The router asks
    # the index for each kind its replicas report, not only for the one whose facts it holds.
    kinds = {"avx512": "cpu:paged_decode_attention=avx512bf16", "gpu": "cuda:NVIDIA H200"}
    chains = {name: block_hashes(PROMPT, MODEL, reproducible=kind) for name, kind in kinds.items()}
    engines = [
        await start_engine([stored(chains["avx512"], engine_pb2.KV_TIER_ENGINE)]),
        await start_engine([stored(chains["gpu"], engine_pb2.KV_TIER_HOST)]),
        await start_engine([stored(CHAIN, engine_pb2.KV_TIER_ENGINE)]),  # the sampled chain only
    ]
    avx512, gpu, sampled = addresses = [engine.address for engine in engines]
    cache = await start(CacheSettings(port=0, engine_addresses=addresses), metrics_port=0)
    channel = create_channel(cache.address)
    stub = cache_pb2_grpc.CacheIndexServiceStub(channel)
    replicas = ReplicaSet(addresses)
    infos = {
        address: engine_pb2.EngineInfo(model=MODEL, block_size=16, reproducible_kernels=kind)
        for address, kind in ((avx512, kinds["avx512"]), (gpu, kinds["gpu"]), (sampled, ""))
    }
    for address, info in infos.items():
        replicas.get(address).info = info
    try:
        deadline = time.monotonic() + 10
        while (
            sum(r.connected for r in (await stub.ListReplicas(cache_pb2.ListReplicasRequest())).replicas) < 3
        ):
            assert time.monotonic() < deadline, "the cache service never followed the three engines"
            await asyncio.sleep(0.02)
        pipeline = RequestPipeline(replicas, None, None, stub, None, PlacementPolicy(), 5.0)  # type: ignore[arg-type]
        greedy = await pipeline._cached_prefix_tokens(infos[avx512], PROMPT, "", reproducible=True)
        # The third replica runs no batch-invariant steps: its greedy blocks are the sampled chain.
        assert greedy == {avx512: 128, gpu: pytest.approx(0.98 * 128), sampled: 128}
        sampled_only = await pipeline._cached_prefix_tokens(infos[avx512], PROMPT, "", reproducible=False)
        assert sampled_only == {sampled: 128}
        # A kind no replica reports is not asked for: with only the first replica's facts known
        # (the others not yet reported), only its chain is matched.
        for address in (gpu, sampled):
            replicas.get(address).info = None
        assert await pipeline._cached_prefix_tokens(infos[avx512], PROMPT, "", reproducible=True) == {
            avx512: 128
        }
    finally:
        await replicas.close()
        await channel.close()
        await cache.stop(grace=None)
        for engine in engines:
            await engine.stop(grace=None)
