"""Queue submission and drain rates through the routers' gRPC, SQLite against PostgreSQL, one
and two routers; the ledger's write rate through the usage service's gRPC (issue 29's targets).

``docs/measurements/queue_store.md`` has the same three rates one level down (``QueueStore``
calls in one process); these are what a client and the engines see. Each setup is a stack of
its own, as ``run-local`` wires one: tokenizer, usage, one engine on the tiny random-weight
model, the cache index and one or two routers, every router and the usage service on the
setup's store (a fresh SQLite folder, or a fresh schema of the PostgreSQL server at
``CACHET_BENCH_POSTGRES_URL``, by default the dev box's 127.0.0.1:5432). In order:

1. **submission**: ``jobs`` completion requests through ``QueueRequests`` in batches of
   ``SUBMIT_BATCH`` from ``SUBMITTERS`` concurrent callers, spread over the routers; jobs/s is
   jobs over wall time. The dispatchers drain meanwhile, as they would in service.
2. **drain**: from the end of submission until every job is stored done, jobs/s counted by
   the routers' ``cachet_router_queue_results_total{outcome="stored"}``. Each job is
   ``PROMPT_TOKENS`` random prompt ids and ``max_tokens=1`` (one prefill, no decode) on the
   tiny model: the queue's cost with as little model work as a job can have. It is still an
   engine's work, on the same cores, so this is a floor on what the queue alone would do.
3. **ledger**: ``ledger_records`` usage records through ``RecordUsageBatch`` in batches of
   ``LEDGER_BATCH`` (what a router sends) from ``LEDGER_CALLERS`` concurrent callers, once the
   drain is over; records/s.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import tempfile
import time
import urllib.request
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import asyncpg
import grpc
from prometheus_client.parser import text_string_to_metric_families

from bench.progress import progress
from bench.queue_bench import _cpu_seconds
from bench.service_chain_bench import MODEL_ID, _Services
from cachet.common.v1 import common_pb2
from cachet.loopback_port import free_loopback_port
from cachet.models.tiny import write_tiny_model
from cachet.router.v1 import router_pb2, router_pb2_grpc
from cachet.usage.v1 import usage_pb2, usage_pb2_grpc

POSTGRES_URL = os.environ.get("CACHET_BENCH_POSTGRES_URL", "postgresql://root@127.0.0.1:5432/test")
PROMPT_TOKENS = 8
TOKEN_RANGE = (1_000, 40_000)  # the tiny model's ordinary vocabulary, past the specials
SUBMIT_BATCH = 100
SUBMITTERS = 4
LEDGER_BATCH = 20
LEDGER_CALLERS = 4
ENGINE_MAX_NUM_SEQS = 64
DRAIN_TIMEOUT_SECONDS = 900.0


@dataclass(frozen=True)
class Setup:
    store: str  # "sqlite" or "postgresql"
    routers: int

    @property
    def name(self) -> str:
        return f"{self.store}, {self.routers} router{'s' if self.routers > 1 else ''}"


SETUPS = (Setup("sqlite", 1), Setup("postgresql", 1), Setup("postgresql", 2))


@dataclass(frozen=True)
class Scale:
    jobs: int
    ledger_records: int


FULL = Scale(jobs=10_000, ledger_records=20_000)
QUICK = Scale(jobs=2_000, ledger_records=4_000)


@dataclass(frozen=True)
class Router:
    address: str
    metrics_port: int


@dataclass(frozen=True)
class Stack:
    usage: str
    routers: list[Router]
    # Each service's process id, by name (the engine's counts its loop process too).
    pids: dict[str, int]


# ------------------------------------------------------------------------------ the stores


@contextmanager
def store_env(setup: Setup) -> Iterator[dict[str, str]]:
    """``CACHET_STORE_URL`` for the router and usage processes: none (SQLite files in their data
    folders), or a fresh PostgreSQL schema, dropped after."""
    if setup.store == "sqlite":
        yield {}
        return
    schema = f"cachet_bench_{os.getpid()}_{uuid.uuid4().hex[:8]}"
    asyncio.run(_postgres_execute(f'CREATE SCHEMA "{schema}"'))
    separator = "&" if urlsplit(POSTGRES_URL).query else "?"
    try:
        yield {"CACHET_STORE_URL": f"{POSTGRES_URL}{separator}search_path={schema}"}
    finally:
        asyncio.run(_postgres_execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE'))


async def _postgres_execute(statement: str) -> None:
    connection = await asyncpg.connect(POSTGRES_URL, timeout=10)
    try:
        await connection.execute(statement)
    finally:
        await connection.close()


# ------------------------------------------------------------------------------ the stack


@contextmanager
def running_stack(root: Path, setup: Setup) -> Iterator[Stack]:
    """Every service of one setup, stopped when the block ends."""
    model_dir = write_tiny_model(root / MODEL_ID)
    services = _Services(root)
    with store_env(setup) as store:
        try:
            yield _start(services, model_dir, setup, store)
        finally:
            services.stop()


def _start(services: _Services, model_dir: Path, setup: Setup, store: dict[str, str]) -> Stack:
    tokenizer = _start_on_free_ports(
        services, "tokenizer", {"CACHET_TOKENIZER_MODELS": json.dumps([str(model_dir)])}
    )
    usage = _start_on_free_ports(
        services, "usage", {"CACHET_DATA_DIR": str(services.log_dir / "usage-data")} | store
    )
    engine = _start_on_free_ports(
        services,
        "engine",
        {"CACHET_MODEL": str(model_dir), "CACHET_ENGINE_MAX_NUM_SEQS": str(ENGINE_MAX_NUM_SEQS)},
    )
    cache = _start_on_free_ports(services, "cache", {"CACHET_CACHE_ENGINE_ADDRESSES": json.dumps([engine])})
    wiring = {
        "CACHET_ROUTER_TOKENIZER_ADDRESS": tokenizer,
        "CACHET_ROUTER_USAGE_ADDRESS": usage,
        "CACHET_ROUTER_CACHE_ADDRESS": cache,
        "CACHET_ROUTER_ENGINE_ADDRESSES": json.dumps([engine]),
    }
    routers = [_start_router(services, index, wiring | store) for index in range(setup.routers)]
    names = ["tokenizer", "usage", "engine", "cache"] + [f"router{index}" for index in range(setup.routers)]
    return Stack(usage, routers, {name: p.pid for name, p in zip(names, services.processes, strict=True)})


def _start_on_free_ports(services: _Services, service: str, env: dict[str, str]) -> str:
    """``service`` with its /metrics on a free port: its default one may be a neighbour's."""
    return services.start(
        service, env | {f"CACHET_{service.upper()}_METRICS_PORT": str(free_loopback_port())}
    )


def _start_router(services: _Services, index: int, env: dict[str, str]) -> Router:
    metrics_port = free_loopback_port()
    own = {
        # Each router its own folder: on SQLite there is only ever one router.
        "CACHET_DATA_DIR": str(services.log_dir / f"router{index}-data"),
        "CACHET_ROUTER_METRICS_PORT": str(metrics_port),
    }
    return Router(services.start("router", env | own, name=f"router{index}"), metrics_port)


# ------------------------------------------------------------------------------ the rates


def _queue_request(rng: random.Random) -> router_pb2.QueueRequestsRequest:
    sampling = common_pb2.SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)

    def job() -> router_pb2.QueuedRequest:
        prompt = [rng.randrange(*TOKEN_RANGE) for _ in range(PROMPT_TOKENS)]
        completion = router_pb2.CompletionRequest(model=MODEL_ID, prompt_token_ids=prompt, sampling=sampling)
        return router_pb2.QueuedRequest(completion=completion)

    return router_pb2.QueueRequestsRequest(model=MODEL_ID, requests=[job() for _ in range(SUBMIT_BATCH)])


async def warm_up(routers: list[Router], rng: random.Random) -> int:
    """One batch through each router, untimed (its first call opens the store's connections);
    returns the jobs queued."""
    for router in routers:
        await _submitter(router, [_queue_request(rng)])
    return len(routers) * SUBMIT_BATCH


async def submit(routers: list[Router], jobs: int, rng: random.Random) -> float:
    """Jobs/s through ``QueueRequests``: ``jobs`` in batches, ``SUBMITTERS`` callers over the routers.
    The batches are built before the clock starts, so the rate is the routers'."""
    batches = [_queue_request(rng) for _ in range(jobs // SUBMIT_BATCH)]
    started = time.perf_counter()
    await asyncio.gather(
        *(
            _submitter(routers[caller % len(routers)], batches[caller::SUBMITTERS])
            for caller in range(SUBMITTERS)
        )
    )
    return len(batches) * SUBMIT_BATCH / (time.perf_counter() - started)


async def _submitter(router: Router, batches: list[router_pb2.QueueRequestsRequest]) -> None:
    async with grpc.aio.insecure_channel(router.address) as channel:
        stub = router_pb2_grpc.InferenceServiceStub(channel)
        for batch in batches:
            await stub.QueueRequests(batch, timeout=60)


def _stored(routers: list[Router]) -> float:
    """Jobs the routers have stored done so far (their own count, from /metrics)."""
    return sum(_stored_by(router) for router in routers)


def _stored_by(router: Router) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{router.metrics_port}/metrics", timeout=5) as response:
        text = response.read().decode()
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        if family.name == "cachet_router_queue_results"
        for sample in family.samples
        if sample.name.endswith("_total") and sample.labels.get("outcome") == "stored"
    )


async def drain(routers: list[Router], jobs: int) -> tuple[float, float]:
    """Jobs/s stored done from now until all ``jobs`` are, and the share already done at the start."""
    done_before, started = await asyncio.to_thread(_stored, routers), time.perf_counter()
    deadline, last_said = started + DRAIN_TIMEOUT_SECONDS, started
    while (done := await asyncio.to_thread(_stored, routers)) < jobs:
        now = time.perf_counter()
        if now > deadline:
            raise RuntimeError(
                f"{jobs - done:.0f} of {jobs} jobs still not done after {DRAIN_TIMEOUT_SECONDS} s"
            )
        if now - last_said >= 10:
            progress(f"    {done:.0f} of {jobs} jobs done")
            last_said = now
        await asyncio.sleep(0.2)
    return (jobs - done_before) / (time.perf_counter() - started), done_before / jobs


def _usage_batch(start: int) -> usage_pb2.RecordUsageBatchRequest:
    records = [
        usage_pb2.UsageRecord(
            request_id=f"ledger-bench-{index}",
            account_id="acct-bench",
            model=MODEL_ID,
            prompt_tokens=PROMPT_TOKENS,
            completion_tokens=1,
            finished_at_ms=int(time.time() * 1000),
            priority="batch",
        )
        for index in range(start, start + LEDGER_BATCH)
    ]
    return usage_pb2.RecordUsageBatchRequest(records=records)


async def ledger(usage: str, records: int) -> float:
    """Records/s through ``RecordUsageBatch``: batches of ``LEDGER_BATCH``, ``LEDGER_CALLERS`` callers."""
    batches = [_usage_batch(start) for start in range(0, records, LEDGER_BATCH)]
    async with grpc.aio.insecure_channel(usage) as channel:
        stub = usage_pb2_grpc.UsageServiceStub(channel)

        async def caller(mine: list[usage_pb2.RecordUsageBatchRequest]) -> None:
            for batch in mine:
                await stub.RecordUsageBatch(batch, timeout=60)

        started = time.perf_counter()
        await asyncio.gather(*(caller(batches[index::LEDGER_CALLERS]) for index in range(LEDGER_CALLERS)))
    return len(batches) * LEDGER_BATCH / (time.perf_counter() - started)


# ------------------------------------------------------------------------------ one run


def _machine_busy_seconds() -> float:
    """CPU seconds every process on the machine has spent busy (not idle or waiting on I/O)."""
    fields = [int(value) for value in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    return (sum(fields) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")


def _cpu_now(pids: dict[str, int]) -> dict[str, float]:
    return {name: _cpu_seconds(pid) for name, pid in pids.items()} | {"machine": _machine_busy_seconds()}


def _cores(pids: dict[str, int], before: dict[str, float], seconds: float) -> dict[str, float]:
    """Cores each service kept busy since ``before`` (``_cpu_now`` then), routers summed; and the
    whole machine's (PostgreSQL's server, and whatever else shares the box)."""
    now, cores = _cpu_now(pids), {}
    for name in now:
        key = "routers" if name.startswith("router") else name
        cores[key] = cores.get(key, 0.0) + (now[name] - before[name]) / seconds
    return cores


async def measure(stack: Stack, scale: Scale) -> dict[str, Any]:
    rng = random.Random(0)
    warm = await warm_up(stack.routers, rng)
    progress(f"  submission: {scale.jobs} jobs in batches of {SUBMIT_BATCH}, {SUBMITTERS} callers")
    submitted = await submit(stack.routers, scale.jobs, rng)
    progress(f"    {submitted:.0f} jobs/s; drain of what is left (max_tokens=1)")
    cpu_before, started = _cpu_now(stack.pids), time.perf_counter()
    drained, done_at_start = await drain(stack.routers, scale.jobs + warm)
    cores = _cores(stack.pids, cpu_before, time.perf_counter() - started)
    progress(f"    {drained:.0f} jobs/s; ledger: {scale.ledger_records} records in batches of {LEDGER_BATCH}")
    written = await ledger(stack.usage, scale.ledger_records)
    progress(f"    {written:.0f} records/s")
    return {
        "submission_jobs_per_s": submitted,
        "drain_jobs_per_s": drained,
        "done_during_submission_share": done_at_start,
        "ledger_records_per_s": written,
        "drain_cores": cores,
    }


def run_setup(setup: Setup, scale: Scale) -> dict[str, Any]:
    progress(f"queue rates: {setup.name}: starting its stack")
    with (
        tempfile.TemporaryDirectory(prefix="cachet-queue-rates-") as directory,
        running_stack(Path(directory), setup) as stack,
    ):
        return asyncio.run(measure(stack, scale))


def run_queue_rates_bench(quick: bool = False) -> dict[str, Any]:
    scale = QUICK if quick else FULL
    result: dict[str, Any] = {
        "jobs": scale.jobs,
        "ledger_records": scale.ledger_records,
        "submit_batch": SUBMIT_BATCH,
        "ledger_batch": LEDGER_BATCH,
        "cpus": os.cpu_count(),
        "setups": {setup.name: run_setup(setup, scale) for setup in SETUPS},
    }
    _print(result)
    return result


def _print(result: dict[str, Any]) -> None:
    setups = result["setups"]
    print(
        f"\nQueue and ledger through gRPC: {result['jobs']} jobs ({PROMPT_TOKENS} prompt tokens, max_tokens=1,"
        f" tiny model, one engine), {result['ledger_records']} ledger records, {result['cpus']} CPUs"
    )
    print(f"{'measure':<48}" + "".join(f"{name:>22}" for name in setups))
    print("-" * (48 + 22 * len(setups)))
    for label, figure in _rows(next(iter(setups.values()))):
        print(f"{label:<48}" + "".join(f"{figure(figures):>22}" for figures in setups.values()))


def _rows(first: dict[str, Any]) -> list[tuple[str, Any]]:
    """The table's rows: a label and how to read its cell from one setup's figures."""
    rows = [
        (
            f"submission, QueueRequests of {SUBMIT_BATCH} (jobs/s)",
            lambda f: f"{f['submission_jobs_per_s']:,.0f}",
        ),
        ("  share of jobs done by its end", lambda f: f"{f['done_during_submission_share']:.2f}"),
        ("drain, jobs stored done (jobs/s)", lambda f: f"{f['drain_jobs_per_s']:,.0f}"),
    ]
    rows += [
        (f"  cores busy in it: {service}", lambda f, service=service: f"{f['drain_cores'][service]:.2f}")
        for service in first["drain_cores"]
    ]
    rows.append(
        (
            f"ledger, RecordUsageBatch of {LEDGER_BATCH} (records/s)",
            lambda f: f"{f['ledger_records_per_s']:,.0f}",
        )
    )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help=f"{QUICK.jobs} jobs instead of {FULL.jobs}")
    args = parser.parse_args()
    print(json.dumps(run_queue_rates_bench(args.quick), indent=2))


if __name__ == "__main__":
    main()
