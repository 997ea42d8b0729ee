"""Admission control over real processes: two engines that take one request each plus one waiting.

When both are full the router refuses at once with RESOURCE_EXHAUSTED and a retry
hint, instead of queueing a synchronous request without bound. A router whose view
is out of date (here: one that hears a load report once a minute) learns it from
the engines' own refusals: it tries the next replica once, then refuses. With no replica
left to try, the caller hears the refusal's own kind: a lone replica that breaks under a
waiting request is UNAVAILABLE (a 503), not RESOURCE_EXHAUSTED (a 429, "merely busy").
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from service_processes import ENGINE_SERVER_BUILT, TINY_MODEL_ID, CachetStack, child_pids

from cachet.common.v1 import common_pb2
from cachet.engine.v1 import engine_pb2, engine_pb2_grpc
from cachet.errors import error_info_from_metadata
from cachet.grpc_channel import create_channel
from cachet.models.tiny import write_tiny_model
from cachet.router.v1 import router_pb2, router_pb2_grpc

TIMEOUT = 120.0


def one_seat_engines(
    tmp_path_factory: pytest.TempPathFactory, name: str, engines: int, max_waiting: int
) -> Iterator[CachetStack]:
    """A stack whose engines run one request at a time and queue ``max_waiting`` more."""
    if not ENGINE_SERVER_BUILT:
        pytest.skip("the engine server (cachet.engine.main) is not built yet")
    root = tmp_path_factory.mktemp(name)
    limits = {"CACHET_ENGINE_MAX_NUM_SEQS": "1", "CACHET_ENGINE_MAX_WAITING": str(max_waiting)}
    running = CachetStack(root, write_tiny_model(root / TINY_MODEL_ID)).start(
        engines=engines, engine_env=limits
    )
    yield running
    running.stop()
    print(running.logs())


@pytest.fixture(scope="module")
def small_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[CachetStack]:
    yield from one_seat_engines(tmp_path_factory, "router-admission", engines=2, max_waiting=1)


def long_chat() -> router_pb2.ChatCompletionRequest:
    message = common_pb2.ChatMessage(
        role="user", content=[common_pb2.ContentPart(text=f"{uuid.uuid4()} Go on.")]
    )
    sampling = common_pb2.SamplingParams(temperature=0.0, max_tokens=1900, ignore_eos=True)
    return router_pb2.ChatCompletionRequest(model=TINY_MODEL_ID, messages=[message], sampling=sampling)


async def engine_load(address: str) -> tuple[int, int]:
    async with create_channel(address) as channel:
        reports = engine_pb2_grpc.EngineServiceStub(channel).StreamLoadReports(
            engine_pb2.StreamLoadReportsRequest(interval_ms=50)
        )
        try:
            async for report in reports:
                return report.running_requests, report.waiting_requests
        finally:
            reports.cancel()
    raise AssertionError("no load report")


async def test_all_replicas_full_is_resource_exhausted_at_once(small_stack: CachetStack) -> None:
    def router_log() -> list[str]:
        return small_stack.processes["router"].log_tail(100_000).splitlines()

    # Started while the engines are idle; its only report says so for the whole test.
    blind = small_stack.start_router(
        "router-blind",
        CACHET_ROUTER_LOAD_REPORT_INTERVAL_MS="60000",
        CACHET_ROUTER_REPORT_STALE_SECONDS="600",
    )
    async with (
        create_channel(small_stack.address("router")) as channel,
        create_channel(blind.address) as blind_channel,
    ):
        inference = router_pb2_grpc.InferenceServiceStub(channel)
        calls = []
        try:
            # One running request per engine (each has streamed a chunk, so it runs).
            first_chunk_seconds = []
            for _ in range(2):
                call = inference.StreamChatCompletion(long_chat(), timeout=TIMEOUT)
                sent = time.monotonic()
                await call.read()
                first_chunk_seconds.append(round(time.monotonic() - sent, 2))
                calls.append(call)
            # One waiting request per engine: they stream nothing until a slot frees.
            calls += [inference.StreamChatCompletion(long_chat(), timeout=TIMEOUT) for _ in range(2)]
            # Each running request is 1,900 tokens: 5-15 s of the tiny model on the 2-core box,
            # while the engines fill up within a poll or two.
            deadline = time.monotonic() + 15
            while (loads := [await engine_load(a) for a in small_stack.engine_addresses]) != [(1, 1), (1, 1)]:
                assert time.monotonic() < deadline, (
                    f"engines never filled up: (running, waiting) {loads}; calls ended: "
                    f"{[(call.done() and (await call.code()).name) for call in calls]}; the running "
                    f"ones' first chunks came after {first_chunk_seconds} s (a second placed "
                    f"behind the first waits for its whole generation); the router's refusals: "
                    f"{[line for line in router_log() if 'at capacity' in line]}"
                )
                await asyncio.sleep(0.05)

            started = time.monotonic()
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await inference.CreateChatCompletion(long_chat(), timeout=TIMEOUT)
            assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert error_info_from_metadata(refused.value.trailing_metadata()).retry_after_seconds >= 1
            assert time.monotonic() - started < 2.0  # refused, not queued behind a 1,900-token generation

            with pytest.raises(grpc.aio.AioRpcError) as engine_refused:
                await router_pb2_grpc.InferenceServiceStub(blind_channel).CreateChatCompletion(
                    long_chat(), timeout=TIMEOUT
                )
            assert engine_refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        finally:
            for call in calls:
                call.cancel()
            blind.stop()
    # Both engines turned it away: the first refusal moved it to the other replica, once.
    refusals = [line for line in blind.log_tail(100_000).splitlines() if "engine refused request" in line]
    assert len(refusals) == 2
    assert {
        address for address in small_stack.engine_addresses if any(address in r for r in refusals)
    } == set(small_stack.engine_addresses)


@pytest.fixture(scope="module")
def one_seat_engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[CachetStack]:
    yield from one_seat_engines(tmp_path_factory, "router-admission-batch", engines=1, max_waiting=4)


async def test_queued_jobs_on_every_seat_do_not_turn_interactive_requests_away(
    one_seat_engine: CachetStack,
) -> None:
    """The engine preempts a queued job to seat an interactive request, so the router places it."""
    (engine_address,) = one_seat_engine.engine_addresses
    async with (
        create_channel(engine_address) as engine_channel,
        create_channel(one_seat_engine.address("router")) as channel,
    ):
        engine = engine_pb2_grpc.EngineServiceStub(engine_channel)
        jobs = [
            engine.Generate(
                engine_pb2.GenerateRequest(
                    request_id=f"job-{index}",
                    model=TINY_MODEL_ID,
                    prompt_token_ids=[1_000 + index] * 20,
                    sampling=common_pb2.SamplingParams(temperature=0.0, max_tokens=1900, ignore_eos=True),
                    priority=common_pb2.PRIORITY_BATCH,
                    output_kind=engine_pb2.OUTPUT_KIND_DELTA,
                ),
                timeout=TIMEOUT,
            )
            # A job is a second or two of the tiny model: four keep the engine busy long enough.
            for index in range(4)
        ]
        try:
            # Whichever job the engine took first runs; the others wait behind it.
            reports = engine.StreamLoadReports(engine_pb2.StreamLoadReportsRequest(interval_ms=50))
            deadline = time.monotonic() + 10
            async for report in reports:
                batch = (report.running_batch_requests, report.waiting_batch_requests)
                if (
                    report.running_requests == 1
                    and report.waiting_requests > 0
                    and batch == (1, report.waiting_requests)
                ):
                    break
                assert time.monotonic() < deadline, f"the jobs never filled the engine: {report}"
            reports.cancel()
            # The router's own reports (every 200 ms) must show it too, or it would place the
            # request whatever its saturation rule says.
            await asyncio.sleep(0.5)

            chat = long_chat()
            chat.sampling.max_tokens = 4
            reply = await router_pb2_grpc.InferenceServiceStub(channel).CreateChatCompletion(
                chat, timeout=TIMEOUT
            )
            assert reply.usage.completion_tokens == 4
        finally:
            for job in jobs:
                job.cancel()


def loop_process_of(engine_pid: int) -> int:
    children = child_pids(engine_pid)
    assert len(children) == 1, f"the engine server should have one child, its loop process: {children}"
    return children[0]


async def test_waiting_request_on_a_lone_broken_replica_is_unavailable(tmp_path: Path) -> None:
    if not ENGINE_SERVER_BUILT:
        pytest.skip("the engine server (cachet.engine.main) is not built yet")
    stack = CachetStack(tmp_path, write_tiny_model(tmp_path / TINY_MODEL_ID)).start(
        engines=1, engine_env={"CACHET_ENGINE_MAX_NUM_SEQS": "1", "CACHET_ENGINE_MAX_WAITING": "2"}
    )
    try:
        engine = stack.processes["engine0"]
        async with create_channel(stack.address("router")) as channel:
            inference = router_pb2_grpc.InferenceServiceStub(channel)
            running = inference.StreamChatCompletion(long_chat(), timeout=TIMEOUT)
            await running.read()
            waiting = inference.StreamChatCompletion(long_chat(), timeout=TIMEOUT)
            deadline = time.monotonic() + 15
            while (load := await engine_load(engine.address)) != (1, 1):
                assert time.monotonic() < deadline, f"the second request never queued: {load}"
                await asyncio.sleep(0.05)

            os.kill(loop_process_of(engine.process.pid), signal.SIGKILL)

            with pytest.raises(grpc.aio.AioRpcError) as failed:
                await waiting.read()
            assert failed.value.code() == grpc.StatusCode.UNAVAILABLE, failed.value.details()
            running.cancel()
        # It was the engine's refusal, not placement finding no replica, that reached the caller.
        refusals = [
            line
            for line in stack.processes["router"].log_tail(100_000).splitlines()
            if "engine refused request" in line
        ]
        assert any("UNAVAILABLE" in line for line in refusals), refusals
    finally:
        stack.stop()
