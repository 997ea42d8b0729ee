"""Start the tokenizer service: load its models, serve gRPC until SIGTERM.

``cachet serve tokenizer`` and ``python -m cachet.tokenizer`` both land in ``main()``;
tests call ``start()`` to get a running server on a port of their choosing.
"""

from __future__ import annotations

import asyncio

from cachet.grpc_server import RunningServer, create_server, serve_until_signalled
from cachet.logs import configure_logging, get_logger
from cachet.models.catalog import (
    DEFAULT_MODEL_ID,
    ResolvedModel,
    ensure_default_model,
    ensure_model,
    resolve_model,
)
from cachet.tokenizer.image_cache import PreparedImageCache
from cachet.tokenizer.images import ImageLimits
from cachet.tokenizer.metrics import ImageCacheCollector
from cachet.tokenizer.model_registry import ModelRegistry
from cachet.tokenizer.servicer import SERVICE_NAME, TokenizerServicer
from cachet.tokenizer.settings import TokenizerSettings
from cachet.tokenizer.tokenizer_model import TokenizerModel
from cachet.tracing import configure_tracing

log = get_logger(__name__)


def _resolve(model: str, settings: TokenizerSettings) -> ResolvedModel:
    resolved = resolve_model(model, settings.data_dir)
    if resolved.path.is_dir():
        return resolved
    # A catalog id whose checkpoint is not written yet (e.g. tiny-llama on a fresh data dir).
    return ensure_model(model, settings.data_dir)


def models_to_load(settings: TokenizerSettings) -> list[ResolvedModel]:
    """``settings.models`` (ids or directories), else ``CACHET_MODEL``, else the default model."""
    if settings.models:
        return [_resolve(model, settings) for model in settings.models]
    if settings.default_model:
        return [_resolve(settings.default_model, settings)]
    return [ResolvedModel(model_id=DEFAULT_MODEL_ID, path=ensure_default_model(settings.data_dir))]


def load_registry(settings: TokenizerSettings) -> ModelRegistry:
    """Resolve and load every configured model (blocking: seconds per model)."""
    models = []
    for resolved in models_to_load(settings):
        model = TokenizerModel.load(resolved.model_id, resolved.path)
        log.info(
            "model loaded", model=model.model_id, path=str(resolved.path), vocab_size=model.info.vocab_size
        )
        models.append(model)
    default = None
    if settings.default_model:
        wanted = resolve_model(settings.default_model, settings.data_dir).model_id
        default = wanted if any(model.model_id == wanted for model in models) else None
    return ModelRegistry(models, default_model_id=default)


def image_limits(settings: TokenizerSettings) -> ImageLimits:
    return ImageLimits(
        max_bytes=settings.image_max_bytes,
        max_pixels=settings.image_max_pixels,
        max_images=settings.max_images_per_request,
        # The answer carries the pixels: leave a quarter of the message for the tokens.
        max_total_pixel_bytes=settings.max_message_bytes * 3 // 4,
        url_hosts=frozenset(host.lower() for host in settings.image_url_hosts),
        fetch_timeout_seconds=settings.image_fetch_timeout_seconds,
    )


async def start(settings: TokenizerSettings, *, metrics_port: int | None = None) -> RunningServer:
    """Load the models and start serving; ``settings.port`` 0 picks a free port; ``metrics_port``
    (0: a free one) also serves Prometheus /metrics."""
    registry = await asyncio.to_thread(load_registry, settings)
    image_cache = PreparedImageCache(settings.image_cache_bytes)
    servicer = TokenizerServicer(
        registry,
        max_input_chars=settings.max_input_chars,
        image_limits=image_limits(settings),
        image_cache=image_cache,
    )
    return await create_server(
        settings,
        [servicer.register],
        [SERVICE_NAME],
        metrics_port=metrics_port,
        metrics_collectors=[ImageCacheCollector(image_cache)],
    )


async def _serve(settings: TokenizerSettings) -> None:
    running = await start(settings, metrics_port=settings.metrics_port or None)
    await serve_until_signalled(running, settings.drain_seconds)


def main(port: int | None = None) -> None:
    """Process entry point: logging, tracing, serve until signalled."""
    settings = TokenizerSettings()
    if port is not None:
        settings = settings.model_copy(update={"port": port})
    configure_logging("tokenizer", settings.log_level)
    configure_tracing("tokenizer")
    asyncio.run(_serve(settings))
