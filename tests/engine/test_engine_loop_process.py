"""The engine loop's process lives and dies with its server (which never loads torch), and the
thread host still serves."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import grpc
import pytest
from service_processes import ServiceProcess, child_pids, launch_service, start_service

from cachet.common.v1 import common_pb2
from cachet.engine.v1 import engine_pb2, engine_pb2_grpc
from cachet.models.tiny import write_tiny_model


def _start_engine(root: Path, **env: str) -> ServiceProcess:
    model_dir = root / "tiny-llama"
    if not model_dir.exists():
        write_tiny_model(model_dir)
    return start_service(
        "engine",
        {"CACHET_MODEL": str(model_dir), "CACHET_DATA_DIR": str(root), "CACHET_KV_CACHE_GB": "0.01"} | env,
        root,
        timeout=300,
    )


def _has_torch(pid: int) -> bool:
    """Whether torch's native library is mapped into the process."""
    return "libtorch" in Path(f"/proc/{pid}/maps").read_text()


def _alive(pid: int) -> bool:
    """Running, not merely a zombie waiting for whoever adopted it to reap it."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    state = next(line for line in status.splitlines() if line.startswith("State:"))
    return "zombie" not in state


def _wait_until(condition, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return condition()


def _generate(max_tokens: int, request_id: str) -> engine_pb2.GenerateRequest:
    return engine_pb2.GenerateRequest(
        request_id=request_id,
        model="tiny-llama",
        prompt_token_ids=[1000 + i for i in range(20)],
        sampling=common_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
    )


async def _tokens(address: str, max_tokens: int) -> list[int]:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = engine_pb2_grpc.EngineServiceStub(channel)
        return [t async for r in stub.Generate(_generate(max_tokens, "r-1")) for t in r.token_ids]


async def test_the_loop_process_serves_and_stops_with_its_server(tmp_path: Path) -> None:
    engine = _start_engine(tmp_path)
    [loop_pid] = child_pids(engine.process.pid)
    assert len(await _tokens(engine.address, 5)) == 5
    # The model is the loop's: the server relays, without torch (memory and start-up time).
    assert _has_torch(loop_pid) and not _has_torch(engine.process.pid)
    assert engine.stop() == 0, engine.log_tail()
    assert _wait_until(lambda: not _alive(loop_pid), 10), "the loop process outlived a clean stop"


async def test_killing_the_server_takes_its_loop_process_down(tmp_path: Path) -> None:
    engine = _start_engine(tmp_path)
    [loop_pid] = child_pids(engine.process.pid)
    engine.stop(signal.SIGKILL)
    assert _wait_until(lambda: not _alive(loop_pid), 10), "an orphaned loop process went on running"


async def test_a_dead_loop_process_fails_requests_and_takes_the_server_down(tmp_path: Path) -> None:
    engine = _start_engine(tmp_path)
    [loop_pid] = child_pids(engine.process.pid)
    async with grpc.aio.insecure_channel(engine.address) as channel:
        stub = engine_pb2_grpc.EngineServiceStub(channel)
        stream = stub.Generate(_generate(2_000, "long"))
        await stream.read()  # the first token: the request is running in the loop process
        os.kill(loop_pid, signal.SIGKILL)
        with pytest.raises(grpc.aio.AioRpcError) as failed:
            while await stream.read() is not grpc.aio.EOF:
                pass
    assert failed.value.code() == grpc.StatusCode.UNAVAILABLE, failed.value
    # A replica without its loop cannot serve: it exits non-zero for its supervisor to restart.
    assert engine.process.wait(15) == 1, engine.log_tail()


async def test_the_thread_host_serves_without_a_loop_process(tmp_path: Path) -> None:
    engine = _start_engine(tmp_path, CACHET_ENGINE_CORE_PROCESS="false")
    assert child_pids(engine.process.pid) == []
    assert len(await _tokens(engine.address, 5)) == 5
    assert engine.stop() == 0, engine.log_tail()


def test_a_loop_process_that_cannot_load_its_model_fails_the_start_with_the_reason(tmp_path: Path) -> None:
    engine = launch_service(
        "engine",
        {"CACHET_MODEL": str(tmp_path / "no-such-model"), "CACHET_DATA_DIR": str(tmp_path)},
        tmp_path,
    )
    assert engine.process.wait(120) != 0
    output = engine.output()
    assert "cachet engine:" in output and "no-such-model" in output, output[-3000:]
    assert "Traceback" not in output.split("engine failed to start")[-1], output[-3000:]
