"""Disaggregated prefill through real processes: a prefill replica computes long prompts and
hands their KV to a decode replica through the shared KV tier (prefill_handoff, kv_handoff).

One stack: tokenizer, usage, cache index, router, and two engines on the tiny model, one of
role prefill and one of role decode, sharing a KV folder."""

from __future__ import annotations

import asyncio
import os
import signal
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from metrics_scrape import growth, scrape
from prometheus_client.parser import text_string_to_metric_families
from service_processes import ENGINE_SERVER_BUILT, TINY_MODEL_ID, CachetStack, child_pids

from cachet.common.v1 import common_pb2
from cachet.engine.v1 import engine_pb2, engine_pb2_grpc
from cachet.grpc_channel import create_channel
from cachet.loopback_port import free_loopback_port
from cachet.models.tiny import write_tiny_model
from cachet.router.v1 import router_pb2, router_pb2_grpc
from cachet.usage.v1 import usage_pb2, usage_pb2_grpc

# The router splits prompts from this many uncached tokens (the tests' prompts have ~150-300).
MIN_TOKENS = 64


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[CachetStack]:
    if not ENGINE_SERVER_BUILT:
        pytest.skip("the engine server (cachet.engine.main) is not built yet")
    root = tmp_path_factory.mktemp("disaggregated")
    running = CachetStack(root, write_tiny_model(root / TINY_MODEL_ID)).start(
        engines=2,
        engine_roles=["prefill", "decode"],
        engine_env={"CACHET_KV_SHARED_DIR": str(root / "kv-shared"), "CACHET_KV_HOST_GB": "0.05"},
        router_env={"CACHET_ROUTER_DISAGG_MIN_TOKENS": str(MIN_TOKENS)},
    )
    yield running
    running.stop()
    print(running.logs())


def _long_chat(nonce: str, max_tokens: int = 8) -> router_pb2.ChatCompletionRequest:
    text = f"[{nonce}] " + " ".join(f"Item {i} of the list is the word number {i}." for i in range(25))
    return router_pb2.ChatCompletionRequest(
        model=TINY_MODEL_ID,
        messages=[common_pb2.ChatMessage(role="user", content=[common_pb2.ContentPart(text=text)])],
        sampling=common_pb2.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
    )


def _handoffs(stack: CachetStack, outcome: str, router: str = "router") -> float:
    text = httpx.get(f"http://127.0.0.1:{stack.processes[router].metrics_port}/metrics", timeout=5).text
    for family in text_string_to_metric_families(text):
        if family.name == "cachet_router_prefill_handoffs":
            for sample in family.samples:
                if sample.name.endswith("_total") and sample.labels.get("outcome") == outcome:
                    return sample.value
    return 0.0


async def _stream(
    stack: CachetStack, request: router_pb2.ChatCompletionRequest, router: str = "router", session: str = ""
) -> list[router_pb2.ChatCompletionChunk]:
    metadata = (("x-session-affinity", session),) if session else ()
    async with create_channel(stack.address(router)) as channel:
        inference = router_pb2_grpc.InferenceServiceStub(channel)
        return [c async for c in inference.StreamChatCompletion(request, metadata=metadata, timeout=120)]


async def test_each_replica_reports_its_role(stack: CachetStack) -> None:
    for name, role in (("engine0", "prefill"), ("engine1", "decode")):
        async with create_channel(stack.address(name)) as channel:
            engine = engine_pb2_grpc.EngineServiceStub(channel)
            info = await engine.GetEngineInfo(engine_pb2.GetEngineInfoRequest(), timeout=10)
            reports = engine.StreamLoadReports(engine_pb2.StreamLoadReportsRequest())
            report = await reports.read()
            reports.cancel()
        assert (info.role, report.role) == (role, role)
        metrics = httpx.get(f"http://127.0.0.1:{stack.processes[name].metrics_port}/metrics", timeout=5).text
        assert f'cachet_engine_role_info{{role="{role}"}} 1.0' in metrics


async def test_a_long_prompt_is_prefilled_on_the_prefill_replica_and_decoded_as_one_replica_would(
    stack: CachetStack,
) -> None:
    prefill, decode = stack.engine_addresses
    handed_off = _handoffs(stack, "handed_off")
    request = _long_chat(uuid.uuid4().hex)
    chunks = await _stream(stack, request)
    assert _handoffs(stack, "handed_off") == handed_off + 1
    text = "".join(c.content_delta for c in chunks)
    usage = chunks[-1].usage
    assert usage.prompt_tokens > MIN_TOKENS
    # The caller's cached tokens are the prefill replica's hits (none: a new prompt), not the
    # blocks the decode replica loaded from the hand-off.
    assert (usage.cached_tokens, usage.completion_tokens) == (0, 8)

    # The same prompt run whole, by a router that never splits, on the decode replica (the only
    # replica taking whole requests): the same greedy answer.
    stack._add(stack.start_router(name="router-whole", CACHET_ROUTER_DISAGG_MIN_TOKENS="1000000"))
    whole = await _stream(stack, request, router="router-whole")
    assert "".join(c.content_delta for c in whole) == text
    assert decode != prefill


async def test_a_short_prompt_goes_straight_to_the_decode_replica(stack: CachetStack) -> None:
    before = _handoffs(stack, "handed_off")
    request = _long_chat(uuid.uuid4().hex)
    request.messages[0].content[0].text = request.messages[0].content[0].text[:40]
    chunks = await _stream(stack, request)
    assert chunks[-1].usage.completion_tokens == 8
    assert _handoffs(stack, "handed_off") == before


async def test_a_shorter_prompt_goes_to_an_idle_prefill_replica_while_the_decode_replica_is_busy(
    stack: CachetStack,
) -> None:
    """Below the split threshold a prompt is prefilled on the prefill replica only while the
    decode replica has requests whose steps its prefill would lengthen, and the prefill replica
    none. (Each prompt is new: one the decode replica had cached would leave it nothing to
    compute.)"""
    stack._add(
        stack.start_router(
            name="router-idle",
            CACHET_ROUTER_DISAGG_MIN_TOKENS="1000000",
            CACHET_ROUTER_DISAGG_IDLE_MIN_TOKENS="16",
        )
    )
    before = _handoffs(stack, "handed_off", router="router-idle")
    alone = await _stream(stack, _long_chat(uuid.uuid4().hex), router="router-idle")
    assert alone[-1].usage.completion_tokens == 8
    assert _handoffs(stack, "handed_off", router="router-idle") == before  # nothing to slow down

    started = asyncio.Event()

    async def keep_the_decode_replica_busy() -> None:
        async with create_channel(stack.address("router-idle")) as channel:
            inference = router_pb2_grpc.InferenceServiceStub(channel)
            async for chunk in inference.StreamChatCompletion(
                _long_chat(uuid.uuid4().hex, max_tokens=1500), timeout=120
            ):
                if chunk.content_delta:
                    started.set()

    busy = asyncio.create_task(keep_the_decode_replica_busy())
    await asyncio.wait_for(started.wait(), 60)
    beside = await _stream(stack, _long_chat(uuid.uuid4().hex), router="router-idle")
    assert not busy.done(), "the busy stream ended before the short prompt was placed"
    assert _handoffs(stack, "handed_off", router="router-idle") == before + 1
    assert beside[-1].usage.completion_tokens == 8
    await busy


async def test_killing_the_prefill_replica_mid_hand_off_costs_no_request(stack: CachetStack) -> None:
    await _kill_the_prefill_replica_mid_hand_off(stack)


async def _kill_the_prefill_replica_mid_hand_off(stack: CachetStack) -> None:
    """Kill -9 the prefill replica while it holds several prompts: each request completes on the
    decode replica, and the ledger holds each once.

    The replica is stopped (SIGSTOP) before the requests arrive, so every one of them is in its
    hands when it dies, whatever the speed of this machine; its load reports stay fresh for
    the router long enough that it is still chosen."""
    engine = stack.processes["engine0"].process
    replica_pids = [engine.pid, *child_pids(engine.pid)]
    failed = _handoffs(stack, "failed")
    for pid in replica_pids:
        os.kill(pid, signal.SIGSTOP)
    session = f"kill-{uuid.uuid4().hex}"
    requests = [_long_chat(uuid.uuid4().hex, max_tokens=6) for _ in range(4)]
    runs = [asyncio.create_task(_stream(stack, r, session=session)) for r in requests]
    await asyncio.sleep(1.0)
    for pid in replica_pids:
        os.kill(pid, signal.SIGKILL)
    results = await asyncio.gather(*runs)
    for chunks in results:
        assert chunks[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
        assert chunks[-1].usage.completion_tokens == 6
    assert _handoffs(stack, "failed") == failed + len(requests)
    async with create_channel(stack.address("usage")) as channel:
        usage = usage_pb2_grpc.UsageServiceStub(channel)
        query = usage_pb2.QueryUsageRequest(session_id=session, group_by=["session"])
        for _ in range(100):
            rows = list((await usage.QueryUsage(query, timeout=10)).rows)
            if rows and rows[0].requests >= len(requests):
                break
            await asyncio.sleep(0.1)
        await asyncio.sleep(0.5)  # a second record of any request would land by now
        rows = list((await usage.QueryUsage(query, timeout=10)).rows)
    assert [row.requests for row in rows] == [len(requests)]
    assert rows[0].completion_tokens == 6 * len(requests)


# ------------------------------------------------- direct transfer, no shared folder


async def test_a_hand_off_is_pushed_directly_between_replicas_of_as_many_ranks() -> None:
    """Ranks pair rank to rank, so replicas sharded alike push directly; others cannot take each
    other's shards, and neither does a replica with no receiver."""
    from cachet.router.prefill_handoff import _direct_transfer_address
    from cachet.router.replica_set import Replica

    def replica(ranks: int, receiver: str) -> Replica:
        one = Replica(f"127.0.0.1:{free_loopback_port()}", stale_seconds=5, report_interval_ms=100)
        one.info = engine_pb2.EngineInfo(tensor_parallel_size=ranks, kv_transfer_address=receiver)
        return one

    replicas = [replica(1, ""), replica(2, ""), replica(1, "127.0.0.1:7"), replica(2, "127.0.0.1:8")]
    try:
        single, sharded, single_decode, sharded_decode = replicas
        assert _direct_transfer_address(single, single_decode) == "127.0.0.1:7"
        assert _direct_transfer_address(sharded, sharded_decode) == "127.0.0.1:8"
        assert _direct_transfer_address(single, sharded_decode) == ""
        assert _direct_transfer_address(sharded, single_decode) == ""
        assert _direct_transfer_address(sharded, sharded) == ""
    finally:
        for one in replicas:
            await one.channel.close()


@pytest.fixture(scope="module")
def direct_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[CachetStack]:
    """Prefill and decode replicas that share no folder: KV goes only through the decode
    replica's receiver (kv_transfer), over a gloo pair."""
    if not ENGINE_SERVER_BUILT:
        pytest.skip("the engine server (cachet.engine.main) is not built yet")
    root = tmp_path_factory.mktemp("disaggregated-direct")
    running = CachetStack(root, write_tiny_model(root / TINY_MODEL_ID)).start(
        engines=2,
        engine_roles=["prefill", "decode"],
        engine_env={"CACHET_KV_HOST_GB": "0.05"},
        each_engine_env=[{}, {"CACHET_ENGINE_KV_TRANSFER_PORT": str(free_loopback_port())}],
        router_env={"CACHET_ROUTER_DISAGG_MIN_TOKENS": str(MIN_TOKENS)},
    )
    yield running
    running.stop()
    print(running.logs())


async def test_a_hand_off_goes_straight_into_the_decode_replicas_memory(direct_stack: CachetStack) -> None:
    stack = direct_stack
    prefill, decode = (stack.processes[name] for name in ("engine0", "engine1"))
    async with create_channel(decode.address) as channel:
        info = await engine_pb2_grpc.EngineServiceStub(channel).GetEngineInfo(
            engine_pb2.GetEngineInfoRequest()
        )
    assert info.role == "decode" and info.kv_transfer_address.startswith("127.0.0.1:")
    before = scrape(decode.metrics_port)
    request = _long_chat(uuid.uuid4().hex)
    chunks = await _stream(stack, request)
    assert _handoffs(stack, "handed_off") == 1
    usage = chunks[-1].usage
    assert (usage.cached_tokens, usage.completion_tokens) == (0, 8)
    grew = growth(before, scrape(decode.metrics_port))
    pushed = grew("cachet_engine_prefix_cache_hit_tokens_total", tier="transfer")
    assert pushed == usage.prompt_tokens // 16 * 16, "every full block came from the prefill replica"
    assert grew("cachet_engine_prefix_cache_hit_tokens_total", tier="shared") == 0
    sent = growth({}, scrape(prefill.metrics_port))("cachet_engine_kv_block_copies_total", direction="send")
    assert sent == pushed // 16
    assert grew("cachet_engine_kv_block_copies_total", direction="receive") == sent
    assert grew("cachet_engine_kv_block_copies_total", direction="receive_dropped") == 0

    stack._add(stack.start_router(name="router-whole", CACHET_ROUTER_DISAGG_MIN_TOKENS="1000000"))
    whole = await _stream(stack, request, router="router-whole")
    assert "".join(c.content_delta for c in whole) == "".join(c.content_delta for c in chunks)


async def test_killing_the_prefill_replica_mid_direct_hand_off_costs_no_request(
    direct_stack: CachetStack,
) -> None:
    """The same with no shared folder: whatever the dead replica pushed or not, the decode
    replica computes what it lacks (last in the file: the stack's prefill replica dies)."""
    await _kill_the_prefill_replica_mid_hand_off(direct_stack)


async def test_tensor_parallel_replicas_hand_off_rank_to_rank(tmp_path: Path) -> None:
    """Two-rank prefill and decode replicas: the router names the decode replica's receiver, each
    prefill rank pushes its shard to the decode rank of its number, and the decode replica
    takes every full block from them (no shared folder to fall back on)."""
    if not ENGINE_SERVER_BUILT:
        pytest.skip("the engine server (cachet.engine.main) is not built yet")
    stack = CachetStack(tmp_path, write_tiny_model(tmp_path / TINY_MODEL_ID)).start(
        engines=2,
        engine_roles=["prefill", "decode"],
        engine_env={"CACHET_KV_HOST_GB": "0.05", "CACHET_TP": "2"},
        each_engine_env=[{}, {"CACHET_ENGINE_KV_TRANSFER_PORT": str(free_loopback_port())}],
        router_env={"CACHET_ROUTER_DISAGG_MIN_TOKENS": str(MIN_TOKENS)},
    )
    try:
        decode = stack.processes["engine1"]
        before = scrape(decode.metrics_port)
        request = _long_chat(uuid.uuid4().hex)
        chunks = await _stream(stack, request)
        assert _handoffs(stack, "handed_off") == 1
        usage = chunks[-1].usage
        grew = growth(before, scrape(decode.metrics_port))
        assert (
            grew("cachet_engine_prefix_cache_hit_tokens_total", tier="transfer")
            == usage.prompt_tokens // 16 * 16
        )
        stack._add(stack.start_router(name="router-whole", CACHET_ROUTER_DISAGG_MIN_TOKENS="1000000"))
        whole = await _stream(stack, request, router="router-whole")
        assert "".join(c.content_delta for c in whole) == "".join(c.content_delta for c in chunks)
    finally:
        stack.stop()
