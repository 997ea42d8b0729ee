"""Two engine processes that share one KV folder: a prompt the first computed is served to the
second from the shared file tier (a session moved to another replica keeps its cache)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from service_processes import ServiceProcess, start_service

from cachet.common.v1 import common_pb2
from cachet.engine.v1 import engine_pb2, engine_pb2_grpc
from cachet.models.tiny import write_tiny_model


@pytest.fixture(scope="module")
def shared_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("shared-kv")


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory, shared_folder: Path) -> Iterator[list[ServiceProcess]]:
    root = tmp_path_factory.mktemp("engines")
    model_dir = write_tiny_model(root / "tiny-llama")
    processes = []
    try:
        for name in ("engine-a", "engine-b"):
            env = {
                "CACHET_MODEL": str(model_dir),
                "CACHET_DATA_DIR": str(root),
                "CACHET_KV_CACHE_GB": "0.01",
                "CACHET_KV_HOST_GB": "0.01",
                "CACHET_KV_SHARED_DIR": str(shared_folder),
            }
            processes.append(start_service("engine", env, root, name=name, timeout=300))
        yield processes
    finally:
        for process in processes:
            assert process.stop() == 0, process.log_tail()


async def _generate(address: str, request_id: str, prompt: list[int]) -> tuple[list[int], int]:
    request = engine_pb2.GenerateRequest(
        request_id=request_id,
        model="tiny-llama",
        prompt_token_ids=prompt,
        sampling=common_pb2.SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
    )
    async with grpc.aio.insecure_channel(address) as channel:
        responses = [r async for r in engine_pb2_grpc.EngineServiceStub(channel).Generate(request)]
    return [t for r in responses for t in r.token_ids], responses[-1].usage.cached_tokens


def _block_files(folder: Path) -> list[Path]:
    return [p for p in folder.rglob("*.kv") if not p.name.startswith(".")]


async def test_the_second_engine_serves_the_first_ones_prompt_from_the_shared_folder(
    engines: list[ServiceProcess], shared_folder: Path
) -> None:
    first, second = engines
    prompt = list(range(300, 350))
    tokens, cached = await _generate(first.address, "a", prompt)
    assert cached == 0
    # 50 tokens: three full blocks, written by the first engine's worker shortly after.
    deadline = time.monotonic() + 30
    while len(_block_files(shared_folder)) < 3:
        assert time.monotonic() < deadline, "the first engine wrote no block files"
        time.sleep(0.05)
    moved_tokens, moved_cached = await _generate(second.address, "b", prompt)
    assert moved_cached == 48
    assert moved_tokens == tokens
