"""Entry point of one engine replica: start the loop where the model runs, serve gRPC.

A single-rank replica's server only relays to its loop process and never imports torch;
where this process runs the model itself (rank 0 of a tensor-parallel replica, a follower,
a loop on a thread), ``loop_builder`` comes in."""

from __future__ import annotations

import asyncio
import os
import uuid
from typing import TYPE_CHECKING, Any

from cachet.engine.async_engine import AsyncEngine, CoreHost
from cachet.engine.core_process import CoreStartFailed, ProcessHost, runs_loop_process
from cachet.engine.deepspeed_ops import StaleBuildLock
from cachet.engine.errors import EngineUnavailable
from cachet.engine.metrics import EngineMetrics
from cachet.engine.rank_environment import externally_launched
from cachet.engine.servicer import SERVICE_NAME, EngineServicer
from cachet.engine.settings import EngineSettings
from cachet.engine.v1 import engine_pb2, engine_pb2_grpc
from cachet.grpc_server import RunningServer, create_server, serve_until_signalled
from cachet.logs import configure_logging, get_logger
from cachet.tracing import configure_tracing

if TYPE_CHECKING:  # model code: imported only where this process runs the model (loop_builder)
    from cachet.engine.loop_builder import RankGroup

log = get_logger(__name__)


def engine_info(
    engine: AsyncEngine, group: RankGroup | None, role: str = "mixed", kv_transfer_address: str = ""
) -> engine_pb2.EngineInfo:
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
        role=role,
        kv_transfer_address=kv_transfer_address,
        reproducible_kernels=description.reproducible_kernels,
    )


def _kv_transfer_address(settings: EngineSettings) -> str:
    if not settings.kv_transfer_port:
        return ""
    host = f"[{settings.host}]" if ":" in settings.host else settings.host
    return f"{host}:{settings.kv_transfer_port}"


async def start(
    settings: EngineSettings,
    group: RankGroup | None = None,
    host: CoreHost | None = None,
    *,
    metrics_port: int | None = None,
) -> tuple[RunningServer, AsyncEngine]:
    """Serve; the loop runs on ``host`` if given (a loop process), else on a thread built here;
    ``metrics_port`` (0: a free one) also serves Prometheus /metrics."""
    if host is None:
        from cachet.engine.core_thread import ThreadHost
        from cachet.engine.loop_builder import build_core_loop

        host = ThreadHost(*await asyncio.to_thread(build_core_loop, settings, group))
    engine = AsyncEngine(
        host, replica_id=uuid.uuid4().hex[:12], stream_interval=settings.stream_interval_ms / 1000
    )
    metrics = EngineMetrics(engine, settings.role)
    engine.start()
    metrics.loop_lag.start()
    servicer = EngineServicer(
        engine,
        engine_info(engine, group, settings.role, _kv_transfer_address(settings)),
        settings.load_report_interval_ms,
    )
    running = await create_server(
        settings,
        [lambda server: engine_pb2_grpc.add_EngineServiceServicer_to_server(servicer, server)],
        [SERVICE_NAME],
        metrics_port=metrics_port,
        metrics_collectors=[metrics.registry],
    )
    return running, engine


def main(port: int | None = None, loop_process: ProcessHost | None = None) -> None:
    """``loop_process``: this replica's loop process, already started (``__main__``); started
    here when it should exist and was not."""
    settings = EngineSettings() if port is None else EngineSettings(port=port)
    configure_logging("engine", settings.log_level)
    if runs_loop_process(settings):
        # The usual replica: the model runs in the loop process, this one only relays (and so
        # never imports torch). TP = EP = 1 is a layout with nothing to refuse.
        host = loop_process or ProcessHost.spawn()
        try:
            host.wait_ready()
        except CoreStartFailed as failed:
            log.error("engine failed to start", error=str(failed))
            raise SystemExit(f"cachet engine: {failed}") from None
        log.info("engine loop process ready", pid=host.pid)
        configure_tracing("engine")
        asyncio.run(_serve(settings, None, host))
        return
    # This process runs the model: rank 0 of a tensor-parallel replica, a follower rank, or a
    # loop on a thread.
    import torch

    from cachet.engine import loop_builder

    torch.set_num_threads(loop_builder.threads_per_rank(settings))
    try:
        # Every rank checks, launched ones too: a rank that went on alone would wait for its
        # peers at the rendezvous instead of failing.
        loop_builder.check_parallel_layout(settings)
    except ValueError as invalid:
        # A start-up mistake in the settings: one line naming them, not a traceback.
        log.error("invalid engine settings", error=str(invalid))
        raise SystemExit(f"cachet engine: {invalid}") from None
    if externally_launched() and int(os.environ["RANK"]) != 0:
        # A launcher started every rank with this same command; only rank 0 serves.
        loop_builder.run_follower(int(os.environ["RANK"]), settings)
        return
    try:
        group = loop_builder.start_rank_group(settings)
    except StaleBuildLock as stale:
        # What to delete, in one line: a start once hung here silently.
        log.error("stale build lock", error=str(stale))
        raise SystemExit(f"cachet engine: {stale}") from None
    configure_tracing("engine")
    asyncio.run(_serve(settings, group, None))


async def _serve(settings: EngineSettings, group: RankGroup | None, host: CoreHost | None) -> None:
    running, engine = await start(settings, group, host, metrics_port=settings.metrics_port or None)

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
    if group is not None and followers:
        disarm = group.watch_followers(lambda text: loop.call_soon_threadsafe(report, text))
    engine_failed = asyncio.ensure_future(engine.wait_failed())
    lost = False
    try:
        watched: set[asyncio.Future[Any]] = {follower_lost, engine_failed}
        await asyncio.wait(watched, return_when=asyncio.FIRST_COMPLETED)
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
    The non-zero status lets the supervisor (run-local's, Kubernetes) see and restart it.
    """
    log.error("replica lost its engine loop or a rank; going down", reason=reason)
    await running.set_serving(False)
    engine.fail(EngineUnavailable(f"this replica broke ({reason}); retry on another replica"))
    await running.stop(grace=2.0)
    os._exit(1)
