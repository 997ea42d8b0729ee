"""Entry point of the usage service: ``python -m cachet.usage`` or ``cachet serve usage``."""

from __future__ import annotations

import asyncio
from functools import partial

from cachet.durable_postgres import StoreNotOpened
from cachet.grpc_server import RunningServer, create_server, serve_until_signalled
from cachet.logs import configure_logging, get_logger
from cachet.tracing import configure_tracing
from cachet.usage.ledger import Ledger, open_ledger
from cachet.usage.prices import load_price_table
from cachet.usage.servicer import SERVICE_NAME, UsageServicer
from cachet.usage.settings import UsageSettings
from cachet.usage.v1 import usage_pb2_grpc

log = get_logger(__name__)

# Strong references to the close-after-stop tasks: the event loop keeps only weak ones.
_closers: set[asyncio.Task[None]] = set()


async def _close_after_termination(running: RunningServer, ledger: Ledger) -> None:
    # Whoever stops the server (a signal, a test), in-flight calls drain first,
    # and only then does the ledger's connection go away under them.
    await running.server.wait_for_termination()
    await ledger.close()
    log.info("usage ledger closed", location=ledger.location)


async def _start(
    settings: UsageSettings, metrics_port: int | None
) -> tuple[RunningServer, asyncio.Task[None]]:
    prices = load_price_table(settings.data_dir)
    ledger = await open_ledger(settings)
    servicer = UsageServicer(ledger, prices)
    try:
        registrar = partial(usage_pb2_grpc.add_UsageServiceServicer_to_server, servicer)
        # The ledger's counters (metrics.py) are in the process-wide registry the endpoint serves.
        running = await create_server(settings, [registrar], [SERVICE_NAME], metrics_port=metrics_port)
    except BaseException:
        await ledger.close()
        raise
    closer = asyncio.create_task(_close_after_termination(running, ledger))
    _closers.add(closer)
    closer.add_done_callback(_closers.discard)
    return running, closer


async def start(settings: UsageSettings, *, metrics_port: int | None = None) -> RunningServer:
    """Load prices, open the ledger and serve; the ledger closes after the server stops.

    ``metrics_port`` (0: a free one) also serves Prometheus /metrics."""
    running, _ = await _start(settings, metrics_port)
    return running


async def _serve(settings: UsageSettings) -> None:
    running, closed = await _start(settings, settings.metrics_port or None)

    async def wait_closed() -> None:
        await closed

    await serve_until_signalled(running, settings.drain_seconds, on_stop=wait_closed)


def main(port: int | None = None) -> None:
    """Serve until SIGTERM/SIGINT; ``port`` overrides ``CACHET_USAGE_PORT``."""
    settings = UsageSettings(port=port) if port is not None else UsageSettings()
    configure_logging("usage", settings.log_level)
    configure_tracing("usage")
    try:
        asyncio.run(_serve(settings))
    except StoreNotOpened as failed:
        log.error("usage ledger not opened", error=str(failed))
        raise SystemExit(f"cachet usage: {failed}") from None
