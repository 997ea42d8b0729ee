"""Entry point of the router: ``python -m cachet.router`` or ``cachet serve router``."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from functools import partial

import grpc

from cachet.cache.v1 import cache_pb2_grpc
from cachet.durable_postgres import StoreNotOpened, is_postgres_url
from cachet.event_loop_lag import EventLoopLagMonitor
from cachet.grpc_channel import create_channel
from cachet.grpc_server import RunningServer, create_server, serve_until_signalled
from cachet.logs import configure_logging, get_logger
from cachet.router import metrics
from cachet.router.batch_queue import BatchQueue
from cachet.router.cache_retention import SETTING_VALUES
from cachet.router.cache_scope import CacheScopes
from cachet.router.caller import AccountDirectory, refuse_open_mode_beyond_loopback
from cachet.router.dispatcher import Dispatcher, HeadroomPolicy
from cachet.router.file_batches import FileBatches
from cachet.router.key_limits import KeyLimiter
from cachet.router.placement import PlacementPolicy
from cachet.router.postgres_key_windows import PostgresKeyWindows
from cachet.router.prefill_handoff import PrefillHandOff
from cachet.router.prompt import PromptBuilder
from cachet.router.queue_store import JobState, QueueStore, open_queue_store
from cachet.router.readiness import ReadinessPublisher
from cachet.router.replica_set import ReplicaSet
from cachet.router.replica_status import ReplicaStatusReader
from cachet.router.request_pipeline import RequestPipeline
from cachet.router.response_retention import ResponseRetention
from cachet.router.servicer import SERVICE_NAME, InferenceServicer
from cachet.router.session_directory import SessionDirectory
from cachet.router.settings import RouterSettings
from cachet.router.stored_responses import StoredResponses
from cachet.router.usage_recorder import UsageRecorder
from cachet.router.v1 import router_pb2_grpc
from cachet.router.webhook_secret import webhook_secret
from cachet.router.webhook_targets import WebhookTargets
from cachet.router.webhooks import WebhookSender
from cachet.tokenizer.v1 import tokenizer_pb2_grpc
from cachet.tracing import configure_tracing
from cachet.usage.v1 import usage_pb2_grpc

log = get_logger(__name__)


@dataclass
class RouterClients:
    """What the router holds open besides its server; closed after the server stops."""

    replicas: ReplicaSet
    usage: UsageRecorder
    channels: list[grpc.aio.Channel] = field(default_factory=list)
    queue: QueueStore | None = None
    dispatcher: Dispatcher | None = None
    webhooks: WebhookSender | None = None
    loop_lag: EventLoopLagMonitor | None = None
    limits: KeyLimiter | None = None
    retention: ResponseRetention | None = None

    async def close(self, drain_seconds: float) -> None:
        if self.loop_lag is not None:
            self.loop_lag.stop()
        # Queued jobs still running go back to the queue first (their usage, if any, drains next).
        if self.dispatcher is not None:
            await self.dispatcher.stop(drain_seconds)
        if self.webhooks is not None:
            await self.webhooks.stop()
        await self.usage.drain(drain_seconds)
        if self.limits is not None:
            await self.limits.close()
        if self.retention is not None:
            await self.retention.stop()
        if self.queue is not None:
            await self.queue.close()
        await self.replicas.close()
        for channel in self.channels:
            await channel.close()


@dataclass
class RunningRouter(RunningServer):
    """A started router: the server plus the clients it must close when it stops."""

    clients: RouterClients | None = None
    readiness: ReadinessPublisher | None = None

    async def stop(self, grace: float | None = 5.0) -> None:
        if self.readiness is not None:
            await self.readiness.stop()
        await super().stop(grace)
        if self.clients is not None:
            await self.clients.close(drain_seconds=grace or 0.0)


async def start(settings: RouterSettings, *, metrics_port: int | None = None) -> RunningServer:
    """Connect to the dependencies, follow the engines and serve; ``port`` 0 picks a free port;
    ``metrics_port`` (0: a free one) also serves Prometheus /metrics."""
    refuse_open_mode_beyond_loopback(settings.api_keys, settings.host)
    tokenizer_channel = create_channel(
        settings.tokenizer_address, settings.max_message_bytes, tls=settings.tls
    )
    cache_channel = create_channel(settings.cache_address, tls=settings.tls)
    usage_channel = create_channel(settings.usage_address, tls=settings.tls)
    replicas = ReplicaSet(
        settings.engine_addresses,
        settings.report_stale_seconds,
        settings.load_report_interval_ms,
        tls=settings.tls,
    )
    usage = UsageRecorder(
        usage_pb2_grpc.UsageServiceStub(usage_channel),
        settings.dependency_timeout_seconds,
        flush_seconds=settings.usage_flush_seconds,
    )
    clients = RouterClients(replicas, usage, [tokenizer_channel, cache_channel, usage_channel])
    tokenizer = tokenizer_pb2_grpc.TokenizerServiceStub(tokenizer_channel)
    cache = cache_pb2_grpc.CacheIndexServiceStub(cache_channel)
    pipeline = RequestPipeline(
        replicas=replicas,
        prompts=PromptBuilder(tokenizer, settings.dependency_timeout_seconds),
        tokenizer=tokenizer,
        cache=cache,
        usage=usage,
        policy=_policy(settings),
        cache_timeout_seconds=settings.cache_timeout_seconds,
        cache_scopes=CacheScopes(isolate=settings.cache_isolation, groups=settings.cache_groups),
        sessions=SessionDirectory(idle_seconds=settings.session_idle_seconds),
        clamp_max_tokens=settings.clamp_max_tokens,
        session_retention=SETTING_VALUES[settings.session_cache_retention],
        prefill_handoff=PrefillHandOff(
            replicas,
            _policy(settings),
            min_tokens=settings.disagg_min_tokens,
            idle_min_tokens=settings.disagg_idle_min_tokens,
            timeout_seconds=settings.disagg_prefill_timeout_seconds,
        ),
    )
    try:
        clients.queue = await open_queue_store(settings)
        # Routers sharing a PostgreSQL store share each key's per-minute counts there too.
        windows = (
            await PostgresKeyWindows.open(settings.store_url) if is_postgres_url(settings.store_url) else None
        )
    except BaseException:
        await clients.close(drain_seconds=0)
        raise
    webhook_targets = WebhookTargets(settings.webhook_allowed_networks)
    clients.webhooks = _webhook_sender(clients.queue, webhook_targets, settings)
    accounts = AccountDirectory(
        settings.api_keys, clients.queue, cache_seconds=settings.api_key_cache_seconds
    )
    limits = clients.limits = KeyLimiter(
        usage_pb2_grpc.UsageServiceStub(usage_channel),
        budget_cache_seconds=settings.budget_cache_seconds,
        timeout_seconds=settings.dependency_timeout_seconds,
        windows=windows,
    )
    usage.on_recorded = limits.recorded
    clients.dispatcher = _dispatcher(clients.queue, pipeline, replicas, clients.webhooks, settings)
    clients.dispatcher.use_keys(accounts, limits)
    replicas.start()
    # Engines started alongside us report within one interval; waiting (bounded) for them
    # keeps the first requests from being refused. Engines that come later join when up.
    if not await replicas.wait_all_reported(settings.startup_wait_seconds):
        log.warning("serving before every engine reported", engines=settings.engine_addresses)
    clients.webhooks.start()
    clients.dispatcher.start()
    clients.retention = _retention(clients.queue, settings)
    clients.loop_lag = EventLoopLagMonitor(metrics.EVENT_LOOP_LAG)
    clients.loop_lag.start()
    queue = BatchQueue(
        clients.queue,
        replicas,
        settings.queue_max_batch_requests,
        settings.default_webhooks,
        on_batch_finished=clients.webhooks.kick,
        webhook_targets=webhook_targets,
    )
    file_batches = FileBatches(clients.queue, queue, settings.batch_file_max_lines)
    replica_status = ReplicaStatusReader(
        replicas, cache, settings.operator_accounts, settings.cache_timeout_seconds
    )
    servicer = InferenceServicer(
        pipeline,
        accounts,
        queue,
        file_batches,
        StoredResponses(clients.queue),
        limits,
        replica_status=replica_status,
    )
    try:
        running = await create_server(
            settings,
            [partial(router_pb2_grpc.add_InferenceServiceServicer_to_server, servicer)],
            [SERVICE_NAME],
            metrics_port=metrics_port,
            metrics_collectors=[
                metrics.QueueCollector(clients.queue.counts_off_the_loop, [state.value for state in JobState])
            ],
        )
    except BaseException:
        await clients.close(drain_seconds=0)
        raise
    readiness = ReadinessPublisher(running.health, lambda: bool(pipeline.list_models()))
    readiness.start()
    return RunningRouter(
        running.server,
        running.port,
        running.health,
        running.service_names,
        running.metrics,
        clients=clients,
        readiness=readiness,
    )


def _policy(options: RouterSettings) -> PlacementPolicy:
    return PlacementPolicy(
        load_penalty_tokens=options.load_penalty_tokens,
        session_slack_tokens=options.session_slack_tokens,
        new_session_slack_tokens=options.new_session_slack_tokens,
        host_tier_weight=options.host_tier_weight,
        shared_tier_weight=options.shared_tier_weight,
    )


def _webhook_sender(store: QueueStore, targets: WebhookTargets, options: RouterSettings) -> WebhookSender:
    return WebhookSender(
        store,
        secret=webhook_secret(options.webhook_secret, options.data_dir),
        targets=targets,
        timeout_seconds=options.webhook_timeout_seconds,
        first_backoff_seconds=options.webhook_first_backoff_seconds,
        max_backoff_seconds=options.webhook_max_backoff_seconds,
        deadline_seconds=options.webhook_deadline_seconds,
    )


def _dispatcher(
    store: QueueStore,
    pipeline: RequestPipeline,
    replicas: ReplicaSet,
    webhooks: WebhookSender,
    options: RouterSettings,
) -> Dispatcher:
    return Dispatcher(
        store,
        pipeline,
        replicas,
        policy=HeadroomPolicy(
            options.batch_max_running_fraction, options.batch_min_free_kv_fraction, options.batch_prefetch
        ),
        lease_seconds=options.queue_lease_seconds,
        poll_seconds=options.queue_poll_seconds,
        max_attempts=options.queue_max_attempts,
        max_in_flight=options.batch_max_in_flight,
        on_batch_finished=webhooks.kick,
    )


def _retention(store: QueueStore, options: RouterSettings) -> ResponseRetention | None:
    """The stored Responses' purge, started; None where they are kept until deleted."""
    if not options.responses_retention_days:
        return None
    retention = ResponseRetention(
        store, options.responses_retention_days, options.responses_purge_interval_seconds
    )
    retention.start()
    return retention


async def _serve(settings: RouterSettings) -> None:
    # RunningRouter.stop (called by serve_until_signalled) also closes the clients.
    running = await start(settings, metrics_port=settings.metrics_port or None)
    await serve_until_signalled(running, settings.drain_seconds)


def main(port: int | None = None) -> None:
    """Serve until SIGTERM/SIGINT; ``port`` overrides ``CACHET_ROUTER_PORT``."""
    settings = RouterSettings(port=port) if port is not None else RouterSettings()
    configure_logging("router", settings.log_level)
    configure_tracing("router")
    try:
        asyncio.run(_serve(settings))
    except StoreNotOpened as failed:
        log.error("queue store not opened", error=str(failed))
        raise SystemExit(f"cachet router: {failed}") from None
