"""Entry point of one engine replica: load the model, start the loop, serve gRPC."""

from __future__ import annotations

import asyncio
import os
import uuid
from pathlib import Path

import torch
from tokenizers import Tokenizer

from cachet.config import EngineSettings
from cachet.engine.async_engine import AsyncEngine
from cachet.engine.engine_core import EngineCore
from cachet.engine.model_runner import ModelRunner, default_dtype
from cachet.engine.scheduler import SchedulerConfig
from cachet.engine.servicer import SERVICE_NAME, EngineServicer
from cachet.engine.v1 import engine_pb2, engine_pb2_grpc
from cachet.grpc_server import RunningServer, create_server, serve_until_signalled
from cachet.logs import configure_logging, get_logger
from cachet.models.catalog import ensure_model
from cachet.tracing import configure_tracing

log = get_logger(__name__)
_GIB = 1024**3


def choose_device(setting: str) -> torch.device:
    if setting == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(setting)


def choose_dtype(setting: str, device: torch.device) -> torch.dtype:
    return default_dtype(device) if setting == "auto" else getattr(torch, setting)


def build_engine(settings: EngineSettings) -> tuple[AsyncEngine, engine_pb2.EngineInfo]:
    """Everything but the server: model, KV pool, scheduler and the loop (not started)."""
    model = ensure_model(settings.model or None, settings.data_dir)
    device = choose_device(settings.device)
    dtype = choose_dtype(settings.dtype, device)
    log.info(
        "loading model", model=model.model_id, path=str(model.path), device=str(device), dtype=str(dtype)
    )
    runner = ModelRunner(
        Path(model.path),
        dtype=dtype,
        device=device,
        kv_cache_bytes=int(settings.kv_cache_gb * _GIB),
        block_size=settings.block_size,
        max_model_len=settings.max_model_len,
    )
    log.info("model loaded", kv_blocks=runner.num_kv_blocks, max_model_len=runner.max_model_len)
    tokenizer_file = Path(model.path) / "tokenizer.json"
    core = EngineCore(
        runner=runner,
        model=model.model_id,
        scheduler_config=SchedulerConfig(
            max_model_len=runner.max_model_len,
            max_num_batched_tokens=settings.max_num_batched_tokens,
            max_num_seqs=settings.max_num_seqs,
            max_waiting=settings.max_waiting,
            eos_token_ids=tuple(runner.eos_token_ids),
        ),
        tokenizer=Tokenizer.from_file(str(tokenizer_file)) if tokenizer_file.exists() else None,
    )
    engine = AsyncEngine(core, replica_id=uuid.uuid4().hex[:12])
    info = engine_pb2.EngineInfo(
        replica_id=engine.replica_id,
        model=model.model_id,
        context_window=runner.max_model_len,
        block_size=runner.block_size,
        total_kv_blocks=runner.num_kv_blocks,
        dtype=str(dtype).removeprefix("torch."),
        tensor_parallel_size=1,
        expert_parallel_size=1,
        device=device.type,
    )
    return engine, info


async def start(settings: EngineSettings) -> tuple[RunningServer, AsyncEngine]:
    engine, info = await asyncio.to_thread(build_engine, settings)
    engine.start()
    servicer = EngineServicer(engine, info, settings.load_report_interval_ms)
    running = await create_server(
        settings,
        [lambda server: engine_pb2_grpc.add_EngineServiceServicer_to_server(servicer, server)],
        [SERVICE_NAME],
    )
    return running, engine


def main(port: int | None = None) -> None:
    settings = EngineSettings() if port is None else EngineSettings(port=port)
    configure_logging("engine", settings.log_level)
    configure_tracing("engine")
    # One process per replica on a shared CPU: more threads than cores only thrash.
    torch.set_num_threads(int(os.environ.get("CACHET_ENGINE_THREADS", torch.get_num_threads())))

    async def serve() -> None:
        running, engine = await start(settings)
        await serve_until_signalled(running, settings.drain_seconds, on_stop=engine.stop)

    asyncio.run(serve())
