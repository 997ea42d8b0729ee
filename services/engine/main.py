"""Entry point of one engine replica: load the model, start the loop, serve gRPC."""

from __future__ import annotations

import asyncio
import os
import uuid
from dataclasses import dataclass, field
from multiprocessing.process import BaseProcess
from pathlib import Path

import torch
from tokenizers import Tokenizer

from cachet.config import EngineSettings
from cachet.engine import distributed
from cachet.engine.async_engine import AsyncEngine, CoreHost
from cachet.engine.core_loop import CoreLoop, EngineDescription
from cachet.engine.core_process import CoreStartFailed, ProcessHost
from cachet.engine.core_thread import ThreadHost
from cachet.engine.engine_core import EngineCore
from cachet.engine.errors import EngineUnavailable
from cachet.engine.expert_parallel import check_expert_parallel_size, check_model_has_experts
from cachet.engine.metrics import EngineMetrics
from cachet.engine.model_runner import ModelRunner, default_dtype
from cachet.engine.models import ModelConfig
from cachet.engine.rank_environment import externally_launched
from cachet.engine.scheduler import SchedulerConfig
from cachet.engine.servicer import SERVICE_NAME, EngineServicer
from cachet.engine.structured_output import GrammarCompiler
from cachet.engine.v1 import engine_pb2, engine_pb2_grpc
from cachet.grpc_server import RunningServer, create_server, serve_until_signalled
from cachet.logs import configure_logging, get_logger
from cachet.models.catalog import ResolvedModel, ensure_model
from cachet.startup_heap import freeze_startup_heap
from cachet.tracing import configure_tracing

log = get_logger(__name__)
_GIB = 1024**3


def choose_device(setting: str) -> torch.device:
    if setting == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(setting)


def choose_dtype(setting: str, device: torch.device) -> torch.dtype:
    return default_dtype(device) if setting == "auto" else getattr(torch, setting)


@dataclass
class RankGroup:
    """Rank 0's view of a tensor-parallel replica: the group, and the followers it spawned."""

    tp: distributed.TensorParallel
    # Empty when a launcher (deepspeed, torchrun) started the ranks.
    followers: list[BaseProcess] = field(default_factory=list)
    runner: distributed.ShardedRunner | None = None

    def wrap(self, runner: ModelRunner) -> distributed.ShardedRunner:
        self.runner = distributed.ShardedRunner(runner, self.tp)
        return self.runner

    def close(self) -> None:
        """Planned shutdown: followers are told to stop, then waited for."""
        if self.runner is not None:
            self.runner.close()
        distributed.stop_followers(self.followers)


def check_parallel_layout(settings: EngineSettings) -> None:
    """Refuse CACHET_TP / CACHET_EP a replica cannot have before any rank starts (ValueError)."""
    ep = settings.expert_parallel_size
    check_expert_parallel_size(ep, settings.tensor_parallel_size)
    if ep > 1:
        # Resolved only here: whether the model has experts is the remaining question.
        model = ensure_model(settings.model or None, settings.data_dir)
        config = ModelConfig.from_model_dir(Path(model.path))
        check_model_has_experts(ep, model.model_id, is_moe=config.moe is not None)


def start_rank_group(settings: EngineSettings) -> RankGroup | None:
    """None for a single-rank replica; otherwise spawn (or join) the ranks and the process group."""
    size = settings.tensor_parallel_size
    if size == 1 and not externally_launched():
        return None
    followers: list[BaseProcess] = []
    if not externally_launched():
        distributed.prepare_local_group(size)
        followers = distributed.spawn_followers(size, run_follower, settings)
    info = distributed.init_distributed(choose_device(settings.device))
    if info.world_size != size:
        raise ValueError(f"tensor_parallel_size={size}, but the launcher started {info.world_size} ranks")
    log.info("rank group up", world_size=info.world_size, spawned=len(followers))
    return RankGroup(distributed.TensorParallel.create(info, settings.expert_parallel_size), followers)


def build_runner(
    settings: EngineSettings, tp: distributed.TensorParallel | None = None
) -> tuple[ModelRunner, ResolvedModel, torch.dtype, torch.device]:
    """The model (this rank's shard of it) and its KV cache; also which model, dtype and device."""
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
        tp=tp,
    )
    return runner, model, dtype, device


def run_follower(rank: int, settings: EngineSettings) -> None:
    """Rank ``rank`` (> 0) of a replica: load its shard, then run what rank 0 sends until told to stop."""
    configure_logging("engine", settings.log_level)
    torch.set_num_threads(threads_per_rank(settings))
    tp = distributed.TensorParallel.create(
        distributed.init_distributed(choose_device(settings.device)), settings.expert_parallel_size
    )
    runner, *_ = build_runner(settings, tp)
    log.info("follower ready", rank=rank, kv_blocks=runner.num_kv_blocks)
    freeze_startup_heap()
    distributed.follow(runner, tp)
    log.info("follower stopped", rank=rank)


def build_core_loop(
    settings: EngineSettings, group: RankGroup | None = None
) -> tuple[CoreLoop, EngineDescription]:
    """Model, KV pool, scheduler: the engine loop (not running), and what the server needs of it."""
    runner, model, dtype, device = build_runner(settings, group.tp if group else None)
    expert_parallel_size = runner.expert_parallel_size
    if group is not None:
        # Same attributes as the local runner; each step also goes out to the followers.
        runner = group.wrap(runner)
    log.info("model loaded", kv_blocks=runner.num_kv_blocks, max_model_len=runner.max_model_len)
    tokenizer_file = Path(model.path) / "tokenizer.json"
    tokenizer = Tokenizer.from_file(str(tokenizer_file)) if tokenizer_file.exists() else None
    core = EngineCore(
        runner=runner,
        model=model.model_id,
        scheduler_config=SchedulerConfig(
            max_model_len=runner.max_model_len,
            max_num_batched_tokens=settings.max_num_batched_tokens,
            max_batch_tokens_per_step=settings.max_batch_tokens_per_step,
            max_num_seqs=settings.max_num_seqs,
            max_batch_running=settings.max_batch_running,
            max_waiting=settings.max_waiting,
            eos_token_ids=tuple(runner.eos_token_ids),
        ),
        tokenizer=tokenizer,
        grammar_compiler=(
            GrammarCompiler(tokenizer, runner.vocab_size, runner.eos_token_ids) if tokenizer else None
        ),
    )
    loop = CoreLoop(core, arrivals_between_layers=settings.arrivals_between_layers)
    description = loop.describe(
        expert_parallel_size=expert_parallel_size, dtype=str(dtype).removeprefix("torch."), device=device.type
    )
    return loop, description


def engine_info(engine: AsyncEngine, group: RankGroup | None) -> engine_pb2.EngineInfo:
    description = engine.description
    return engine_pb2.EngineInfo(
        replica_id=engine.replica_id,
        model=description.model,
        context_window=description.context_window,
        block_size=description.block_size,
        total_kv_blocks=description.total_kv_blocks,
        dtype=description.dtype,
        tensor_parallel_size=group.tp.size if group else 1,
        expert_parallel_size=description.expert_parallel_size,
        device=description.device,
    )


async def start(
    settings: EngineSettings, group: RankGroup | None = None, host: CoreHost | None = None
) -> tuple[RunningServer, AsyncEngine]:
    """Serve; the loop runs on ``host`` if given (a loop process), else on a thread built here."""
    if host is None:
        host = ThreadHost(*await asyncio.to_thread(build_core_loop, settings, group))
    engine = AsyncEngine(
        host, replica_id=uuid.uuid4().hex[:12], stream_interval=settings.stream_interval_ms / 1000
    )
    metrics = EngineMetrics(engine)
    if settings.metrics_port:
        # Lives as long as the process, as the router's does.
        metrics.serve(settings.metrics_port, settings.host)
        log.info("metrics serving", metrics_port=settings.metrics_port)
    engine.start()
    servicer = EngineServicer(engine, engine_info(engine, group), settings.load_report_interval_ms)
    running = await create_server(
        settings,
        [lambda server: engine_pb2_grpc.add_EngineServiceServicer_to_server(servicer, server)],
        [SERVICE_NAME],
    )
    return running, engine


def main(port: int | None = None, loop_process: ProcessHost | None = None) -> None:
    """``loop_process``: this replica's loop process, already started (``__main__``); started
    here when it should exist and was not."""
    settings = EngineSettings() if port is None else EngineSettings(port=port)
    configure_logging("engine", settings.log_level)
    torch.set_num_threads(threads_per_rank(settings))
    try:
        # Every rank checks, launched ones too: a rank that went on alone would wait for its
        # peers at the rendezvous instead of failing.
        check_parallel_layout(settings)
    except ValueError as invalid:
        # A start-up mistake in the settings: one line naming them, not a traceback.
        log.error("invalid engine settings", error=str(invalid))
        raise SystemExit(f"cachet engine: {invalid}") from None
    if externally_launched() and int(os.environ["RANK"]) != 0:
        # A launcher started every rank with this same command; only rank 0 serves.
        run_follower(int(os.environ["RANK"]), settings)
        return
    group = start_rank_group(settings)
    host = None
    if group is None and settings.core_process:
        host = loop_process or ProcessHost.spawn()
        try:
            host.wait_ready()
        except CoreStartFailed as failed:
            log.error("engine failed to start", error=str(failed))
            raise SystemExit(f"cachet engine: {failed}") from None
        log.info("engine loop process ready", pid=host.pid)
    configure_tracing("engine")
    asyncio.run(_serve(settings, group, host))


def threads_per_rank(settings: EngineSettings) -> int:
    """One process per replica on a shared CPU: more threads than cores only thrash, and the
    ranks of a replica on one host share its cores (2 ranks x 2 threads on 2 cores: 24x slower)."""
    if "CACHET_ENGINE_THREADS" in os.environ:
        return int(os.environ["CACHET_ENGINE_THREADS"])
    ranks_here = int(os.environ.get("LOCAL_SIZE", settings.tensor_parallel_size))
    return max(1, torch.get_num_threads() // ranks_here)


async def _serve(settings: EngineSettings, group: RankGroup | None, host: CoreHost | None) -> None:
    running, engine = await start(settings, group, host)

    async def on_stop() -> None:
        await engine.stop()
        if group is not None:
            await asyncio.to_thread(group.close)

    serving = asyncio.create_task(serve_until_signalled(running, settings.drain_seconds, on_stop=on_stop))
    lost = asyncio.create_task(_replica_lost(group, engine))
    done, _ = await asyncio.wait({serving, lost}, return_when=asyncio.FIRST_COMPLETED)
    if serving in done:
        lost.cancel()
        return
    await _go_down(running, engine, lost.result())


async def _replica_lost(group: RankGroup | None, engine: AsyncEngine) -> str:
    """Resolves with a reason when the engine loop fails (its process died, a collective raised)
    or a follower dies."""
    loop = asyncio.get_running_loop()
    follower_lost: asyncio.Future[str] = loop.create_future()

    def report(text: str) -> None:
        if not follower_lost.done():
            follower_lost.set_result(text)

    followers = group.followers if group is not None else []
    if followers:
        disarm = distributed.watch_followers(followers, lambda text: loop.call_soon_threadsafe(report, text))
    engine_failed = asyncio.ensure_future(engine.wait_failed())
    lost = False
    try:
        await asyncio.wait({follower_lost, engine_failed}, return_when=asyncio.FIRST_COMPLETED)
        lost = True
        if engine_failed.done():
            return f"engine loop failed: {engine_failed.result()}"
        return follower_lost.result()
    finally:
        engine_failed.cancel()
        if followers and not lost:
            disarm()  # a planned shutdown: followers exiting now is expected


async def _go_down(running: RunningServer, engine: AsyncEngine, reason: str) -> None:
    """The loop or a rank is gone, so the replica is: NOT_SERVING, every in-flight request
    fails, exit.

    ``os._exit``: the engine thread may be blocked in a collective with the dead rank
    (the shared-memory all-reduce never times out), so a normal exit could wait forever.
    The non-zero status lets the supervisor (honcho, Kubernetes) see and restart it.
    """
    log.error("replica lost its engine loop or a rank; going down", reason=reason)
    await running.set_serving(False)
    engine.fail(EngineUnavailable(f"this replica broke ({reason}); retry on another replica"))
    await running.stop(grace=2.0)
    os._exit(1)
