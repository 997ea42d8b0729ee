"""``python -m cachet.bridge`` / ``cachet serve bridge``: the REST API on uvicorn until SIGTERM."""

from __future__ import annotations

import uvicorn

from cachet.bridge.app import create_app
from cachet.bridge.settings import BridgeSettings
from cachet.logs import configure_logging, get_logger
from cachet.startup_heap import freeze_startup_heap
from cachet.tls import check_listener, is_loopback, uvicorn_options
from cachet.tracing import configure_tracing

log = get_logger(__name__)


def main(port: int | None = None) -> None:
    """Serve on ``settings.host:port``; SIGTERM stops accepting, lets in-flight requests finish, then exits."""
    settings = BridgeSettings()
    if port is not None:
        settings = settings.model_copy(update={"port": port})
    configure_logging("bridge", settings.log_level)
    configure_tracing("bridge")
    if not settings.api_keys and not is_loopback(settings.host):
        # create_app refuses too; saying it here first gives the operator the one line to fix.
        log.error("refusing to serve without API keys on a non-loopback host", host=settings.host)
        raise SystemExit(2)
    check_listener(settings.host, settings.tls, "bridge")
    app = create_app(settings)
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        # Keep our JSON logging: uvicorn's own dictConfig would replace the root handlers.
        log_config=None,
        access_log=False,
        # Streams and long generations in flight get this long to finish after SIGTERM.
        timeout_graceful_shutdown=int(settings.drain_seconds),
        lifespan="on",
        **uvicorn_options(settings.tls),
    )
    log.info(
        "bridge starting",
        address=settings.address,
        router=settings.router_address,
        tls=settings.tls.serves_tls,
    )
    freeze_startup_heap()
    uvicorn.Server(config).run()
