"""`cachet run-local`: every service on this machine, the default model, SQLite.

Processes are supervised by ``supervisor.Supervisor`` (output multiplexed with a name
prefix; one that crashes is restarted with backoff, and one that keeps crashing stops
everything with the reason; Ctrl-C or SIGTERM stops all). A watcher thread
polls each service's health and prints the REST URL once everything is up (the
router once it has heard from an engine).
Services are started by module name, so this file knows their names and ports,
never their code.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass, field, replace
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from cachet.config import LOOPBACK
from cachet.durable_postgres import is_postgres_url
from cachet.engine_layout import EngineLayout, available_cores, plan_engine_layout
from cachet.loopback_port import free_loopback_port
from cachet.router.v1 import router_pb2, router_pb2_grpc
from cachet.supervisor import Supervisor
from cachet.tls import TlsSettings, blocking_channel, http_client_context

TOKENIZER_PORT = 50051
ENGINE_BASE_PORT = 50061
# Engine replica i's KV receiver (a decode replica's; its rank 0 listens): ENGINE_KV_TRANSFER_BASE_PORT + i.
ENGINE_KV_TRANSFER_BASE_PORT = 50161
CACHE_PORT = 50071
USAGE_PORT = 50081
ROUTER_PORT = 50091
HEALTH_TIMEOUT_SECONDS = 600
# Each prefill or decode replica's host KV tier unless CACHET_KV_HOST_GB says: the shared
# tier, through which they hand KV over, needs one. Modest: every replica on the host takes it.
DEFAULT_KV_HOST_GB = "1"


@dataclass(frozen=True)
class PlannedService:
    name: str
    module: str
    env: dict[str, str] = field(default_factory=dict)
    grpc_port: int | None = None
    http_port: int | None = None
    # Where its Prometheus /metrics is served (the bridge's: on its REST port).
    metrics_port: int | None = None
    # Ready only once it lists a model: the router serves before slow engines have
    # reported, and refuses what it takes meanwhile.
    ready_when_it_lists_a_model: bool = False


def check_routers(routers: int) -> None:
    """Several routers must share their queue and ledger: a PostgreSQL store, not the SQLite
    files each would otherwise keep apart (a job queued through one would be invisible to the
    other, and a router's death would strand its jobs)."""
    if routers > 1 and not is_postgres_url(os.environ.get("CACHET_STORE_URL", "")):
        raise SystemExit(
            f"run-local: CACHET_ROUTERS={routers} needs the routers to share one store: set "
            "CACHET_STORE_URL=postgresql://user@host:port/database"
        )


def prefill_replicas_from_env() -> int:
    """``CACHET_PREFILL_REPLICAS``: engine replicas that only prefill (disaggregated prefill,
    docs/ARCHITECTURE.md); 0, the default, runs mixed replicas only."""
    value = os.environ.get("CACHET_PREFILL_REPLICAS", "0")
    try:
        count = int(value)
    except ValueError:
        count = -1
    if count < 0:
        raise SystemExit(f"run-local: CACHET_PREFILL_REPLICAS={value} must be a whole number, 0 or more")
    host_gb = os.environ.get("CACHET_KV_HOST_GB")
    if count and host_gb is not None and _gigabytes(host_gb) <= 0:
        # The engines would refuse it at start, and the supervisor restart them until it gave up.
        raise SystemExit(
            f"run-local: CACHET_PREFILL_REPLICAS={count} hands KV over through the shared KV tier, "
            f"which needs a host KV tier: CACHET_KV_HOST_GB={host_gb} must be more than 0 (unset: "
            f"{DEFAULT_KV_HOST_GB})"
        )
    return count


def _gigabytes(value: str) -> float:
    try:
        return float(value)
    except ValueError:
        return 0.0


def engine_roles(replicas: int, prefill_replicas: int) -> list[str]:
    """Each engine replica's CACHET_ENGINE_ROLE, by index: without prefill replicas every one is
    mixed; with them the first ``replicas - prefill_replicas`` decode and the rest prefill."""
    if not prefill_replicas:
        return ["mixed"] * replicas
    return ["decode"] * (replicas - prefill_replicas) + ["prefill"] * prefill_replicas


def engine_name(index: int, role: str) -> str:
    """``engine<i>`` as always, or the role and index (``decode0``, ``prefill1``), so every log
    line of a disaggregated run says which half wrote it."""
    return f"{'engine' if role == 'mixed' else role}{index}"


def shared_tier_env() -> dict[str, str]:
    """What prefill and decode replicas need to hand KV over: one folder they all see (default
    ``<CACHET_DATA_DIR>/kv-shared``) and a host KV tier (``DEFAULT_KV_HOST_GB`` unless set)."""
    shared = Path(os.environ.get("CACHET_DATA_DIR", "data")).resolve() / "kv-shared"
    return {
        "CACHET_KV_SHARED_DIR": os.environ.get("CACHET_KV_SHARED_DIR") or str(shared),
        "CACHET_KV_HOST_GB": os.environ.get("CACHET_KV_HOST_GB") or DEFAULT_KV_HOST_GB,
    }


def plan_services(
    rest_port: int, layout: EngineLayout, model_dir: Path, routers: int = 1, prefill_replicas: int = 0
) -> list[PlannedService]:
    """The processes to start, with the addresses each needs; the REST bridge is the last.

    Several routers listen on consecutive ports and share one store (``check_routers``), one
    cache index and the engines; the bridge spreads its calls over them (round robin).
    ``prefill_replicas`` of ``layout.replicas`` are prefill replicas (the last ones), the others
    decode; the routers and the cache index follow them all (the routers read each one's role
    from its EngineInfo)."""
    replicas = layout.replicas
    roles = engine_roles(replicas, prefill_replicas)
    engines = [f"{LOOPBACK}:{ENGINE_BASE_PORT + i}" for i in range(replicas)]
    model_env = {"CACHET_MODEL": str(model_dir)}
    # CACHET_TP=N: each engine replica is N ranks; its `python -m cachet.engine` spawns ranks
    # 1..N-1 itself, so the supervisor still sees one process per replica (if a rank dies, the
    # replica exits and the supervisor restarts it, ranks and all). CACHET_EP (1 or N, MoE models) rides along and
    # every replica checks it at start.
    engine_env = {
        **model_env,
        "CACHET_TP": str(layout.ranks_per_replica),
        "CACHET_EP": os.environ.get("CACHET_EP", "1"),
        # Each rank's share of the cores (engine_layout), unless the operator chose: left to
        # itself every replica would take them all.
        "CACHET_ENGINE_THREADS": os.environ.get("CACHET_ENGINE_THREADS", str(layout.threads_per_rank)),
        # ...and of free memory for their KV pools, unless the operator chose.
        "CACHET_ENGINE_KV_CACHE_MEMORY_FRACTION": os.environ.get(
            "CACHET_ENGINE_KV_CACHE_MEMORY_FRACTION", str(layout.kv_cache_memory_fraction)
        ),
    }
    plan = [
        PlannedService(
            "tokenizer",
            "cachet.tokenizer",
            {**model_env, "CACHET_TOKENIZER_PORT": str(TOKENIZER_PORT)},
            grpc_port=TOKENIZER_PORT,
        ),
        PlannedService("usage", "cachet.usage", {"CACHET_USAGE_PORT": str(USAGE_PORT)}, grpc_port=USAGE_PORT),
    ]
    if prefill_replicas:
        engine_env |= shared_tier_env()
    plan += [
        PlannedService(
            engine_name(i, role),
            "cachet.engine",
            {
                **engine_env,
                **layout.replica_devices(i),
                "CACHET_ENGINE_PORT": str(ENGINE_BASE_PORT + i),
                # Unset when mixed: an operator's CACHET_ENGINE_ROLE still reaches the engines.
                **({} if role == "mixed" else {"CACHET_ENGINE_ROLE": role}),
                # Prefill replicas push KV straight into a decode replica's memory, each rank its
                # own shard (the shared folder stays the fallback).
                **(
                    {"CACHET_ENGINE_KV_TRANSFER_PORT": str(ENGINE_KV_TRANSFER_BASE_PORT + i)}
                    if role == "decode"
                    else {}
                ),
            },
            grpc_port=ENGINE_BASE_PORT + i,
        )
        for i, role in enumerate(roles)
    ]
    plan += [
        PlannedService(
            "cache",
            "cachet.cache",
            {"CACHET_CACHE_PORT": str(CACHE_PORT), "CACHET_CACHE_ENGINE_ADDRESSES": json.dumps(engines)},
            grpc_port=CACHE_PORT,
        ),
    ]
    router_ports = [ROUTER_PORT + i for i in range(routers)]
    plan += [
        PlannedService(
            "router" if routers == 1 else f"router{i}",
            "cachet.router",
            {
                "CACHET_ROUTER_PORT": str(port),
                "CACHET_ROUTER_ENGINE_ADDRESSES": json.dumps(engines),
                "CACHET_ROUTER_TOKENIZER_ADDRESS": f"{LOOPBACK}:{TOKENIZER_PORT}",
                "CACHET_ROUTER_CACHE_ADDRESS": f"{LOOPBACK}:{CACHE_PORT}",
                "CACHET_ROUTER_USAGE_ADDRESS": f"{LOOPBACK}:{USAGE_PORT}",
            },
            grpc_port=port,
            ready_when_it_lists_a_model=True,
        )
        for i, port in enumerate(router_ports)
    ]
    # gRPC's ipv4: target names every router; the channel's round-robin policy spreads calls
    # over those that are up.
    router_address = (
        f"{LOOPBACK}:{ROUTER_PORT}"
        if routers == 1
        else "ipv4:" + ",".join(f"{LOOPBACK}:{port}" for port in router_ports)
    )
    plan.append(
        PlannedService(
            "bridge",
            "cachet.bridge",
            {"CACHET_PORT": str(rest_port), "CACHET_BRIDGE_ROUTER_ADDRESS": router_address},
            http_port=rest_port,
        )
    )
    return [_with_metrics_port(service) for service in plan]


def _with_metrics_port(service: PlannedService) -> PlannedService:
    """The service with a free loopback port for its /metrics: the services' default ports are
    one per service, and a machine's replicas (or another checkout's run-local) would share them.
    The bridge serves /metrics on its REST port."""
    if service.http_port is not None:
        return replace(service, metrics_port=service.http_port)
    port = free_loopback_port()
    variable = f"CACHET_{service.module.removeprefix('cachet.').upper()}_METRICS_PORT"
    return replace(service, env={**service.env, variable: str(port)}, metrics_port=port)


def metrics_urls(services: list[PlannedService]) -> str:
    """One line per service: where Prometheus scrapes it (https under a certificate, as the REST API)."""
    scheme = _scheme(TlsSettings())
    return "\n".join(
        f"  {service.name:<10} {scheme}://{LOOPBACK}:{service.metrics_port}/metrics"
        for service in services
        if service.metrics_port is not None
    )


def _grpc_healthy(port: int) -> bool:
    try:
        with blocking_channel(f"{LOOPBACK}:{port}", TlsSettings()) as channel:
            # types-grpcio-health-checking declares HealthStub without its methods.
            stub = health_pb2_grpc.HealthStub(channel)
            reply = stub.Check(health_pb2.HealthCheckRequest(), timeout=1)  # type: ignore[attr-defined]
            return reply.status == health_pb2.HealthCheckResponse.SERVING
    except grpc.RpcError:
        return False


def _http_healthy(port: int) -> bool:
    try:
        tls = TlsSettings()
        url = f"{_scheme(tls)}://{LOOPBACK}:{port}/health"
        with urllib.request.urlopen(url, timeout=1, context=http_client_context(tls)) as response:
            return response.status == 200
    except OSError:
        return False


def _lists_a_model(port: int) -> bool:
    """Whether the router has heard from an engine (a request it takes before then is refused:
    "no engine replica is reachable yet"); the URL is announced once it can be used."""
    try:
        with blocking_channel(f"{LOOPBACK}:{port}", TlsSettings()) as channel:
            reply = router_pb2_grpc.InferenceServiceStub(channel).ListModels(
                router_pb2.ListModelsRequest(), timeout=1
            )
            return bool(reply.models)
    except grpc.RpcError:
        return False


def is_healthy(service: PlannedService) -> bool:
    if service.http_port is not None:
        return _http_healthy(service.http_port)
    if service.grpc_port is None or not _grpc_healthy(service.grpc_port):
        return False
    return not service.ready_when_it_lists_a_model or _lists_a_model(service.grpc_port)


def entry_url(services: list[PlannedService]) -> str:
    bridge = next(s for s in services if s.http_port is not None)
    return f"Cachet REST API on {_scheme(TlsSettings())}://{LOOPBACK}:{bridge.http_port}"


def _scheme(tls: TlsSettings) -> str:
    # Every service reads the same CACHET_TLS_* from run-local's environment: a certificate
    # means the bridge and every /metrics serve HTTPS (and the probes need the CA to verify it).
    return "https" if tls.serves_tls else "http"


def _announce_when_healthy(supervisor: Supervisor, services: list[PlannedService]) -> None:
    deadline = time.monotonic() + HEALTH_TIMEOUT_SECONDS
    pending = list(services)
    while pending and time.monotonic() < deadline:
        pending = [service for service in pending if not is_healthy(service)]
        if pending:
            time.sleep(0.5)
    if pending:
        names = ", ".join(s.name for s in pending)
        print(f"run-local: not healthy after {HEALTH_TIMEOUT_SECONDS} s: {names}; stopping", flush=True)
        supervisor.terminate()
        return
    print(entry_url(services), flush=True)
    print(f"Prometheus metrics:\n{metrics_urls(services)}", flush=True)


def machine_layout(replicas: int | None, prefill_replicas: int = 0) -> EngineLayout:
    """The engine layout for this machine: ``CACHET_TP`` ranks a replica, ``replicas`` of them
    (None: as many as the machine suits) plus ``prefill_replicas``, the cores (or GPUs) divided
    between all their ranks. With prefill replicas and no ``replicas``, the machine's count is
    shared: as many decode replicas as it leaves, at least one."""
    cores, gpus = available_cores(), _engine_gpus()
    ranks_per_replica = int(os.environ.get("CACHET_TP", "1"))
    if replicas is None and prefill_replicas:
        suits = plan_engine_layout(cores=cores, gpus=gpus, ranks_per_replica=ranks_per_replica, replicas=None)
        replicas = max(1, suits.replicas - prefill_replicas)
    return plan_engine_layout(
        cores=cores,
        gpus=gpus,
        ranks_per_replica=ranks_per_replica,
        replicas=None if replicas is None else replicas + prefill_replicas,
    )


def _engine_gpus() -> int:
    if os.environ.get("CACHET_DEVICE", "auto") == "cpu":
        return 0
    import torch  # a second of start-up, paid only by the supervisor that sizes engines

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def engine_summary(services: list[PlannedService]) -> str:
    """One line naming each engine replica's role and address (a disaggregated run's)."""
    return "run-local: engine replicas: " + ", ".join(
        f"{s.name} ({s.env.get('CACHET_ENGINE_ROLE', 'mixed')}) on {LOOPBACK}:{s.grpc_port}"
        for s in services
        if s.module == "cachet.engine"
    )


def run_local(rest_port: int, replicas: int | None, model_dir: Path, routers: int = 1) -> int:
    prefill_replicas = prefill_replicas_from_env()
    layout = machine_layout(replicas, prefill_replicas)
    if layout.warning is not None:
        print(f"run-local: warning: {layout.warning}", flush=True)
    print(
        f"run-local: {layout.replicas} engine replica(s) x {layout.ranks_per_replica} rank(s) x "
        f"{layout.threads_per_rank} math thread(s)",
        flush=True,
    )
    services = plan_services(rest_port, layout, model_dir, routers, prefill_replicas)
    if prefill_replicas:
        tier = shared_tier_env()
        default = "" if os.environ.get("CACHET_KV_HOST_GB") else " (default; CACHET_KV_HOST_GB sets it)"
        print(engine_summary(services), flush=True)
        direct = "directly (each decode replica's KV receiver) and " if layout.ranks_per_replica == 1 else ""
        print(
            f"run-local: prefill and decode replicas hand KV over {direct}through {tier['CACHET_KV_SHARED_DIR']}, "
            f"each with a {tier['CACHET_KV_HOST_GB']} GB host KV tier{default}",
            flush=True,
        )
    supervisor = Supervisor()
    for service in services:
        supervisor.add(service.name, [sys.executable, "-m", service.module], {**os.environ, **service.env})
    watcher = threading.Thread(target=_announce_when_healthy, args=(supervisor, services), daemon=True)
    watcher.start()
    return supervisor.run()
