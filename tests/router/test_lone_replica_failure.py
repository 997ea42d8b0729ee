"""What a caller hears when the only replica breaks under its waiting request.

The router retries a request an engine turned away (RESOURCE_EXHAUSTED or UNAVAILABLE) on
another replica. With none left, the caller must hear the refusal's own kind: a replica
that is down is UNAVAILABLE (a 503), not RESOURCE_EXHAUSTED ("at capacity", a 429), which
would tell a client the service is merely busy.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
import uuid
from pathlib import Path

import grpc
import pytest
from service_processes import ENGINE_SERVER_BUILT, TINY_MODEL_ID, CachetStack

from cachet.common.v1 import common_pb2
from cachet.engine.v1 import engine_pb2, engine_pb2_grpc
from cachet.grpc_channel import create_channel
from cachet.models.tiny import write_tiny_model
from cachet.router.v1 import router_pb2, router_pb2_grpc

TIMEOUT = 120.0


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


def loop_process_of(engine_pid: int) -> int:
    children = [
        int(child)
        for task in Path(f"/proc/{engine_pid}/task").iterdir()
        for child in (task / "children").read_text().split()
    ]
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
