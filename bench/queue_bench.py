"""What an async backlog costs interactive traffic, how much free capacity it uses, how fast it fills.

Targets (issue 8): interactive p50 and p99 time to first token with a large backlog at
most 1.1x those without it; the backlog drains using at least 90% of the capacity that
interactive traffic leaves free; 100,000 queued requests keep the dispatcher's memory
flat and go in at over 1,000 requests/s.

One run starts tokenizer, usage, cache, one engine (the tiny random-weight model, or the
model ``--model`` names; ``python -m bench`` names the default one) and the router (whose dispatcher drains the queue), each its own process on loopback, as
``run-local`` wires them. Every request, interactive or queued, has the same shape: a
prompt of ``PROMPT_TOKENS`` random token ids (no two share a prefix block) and
``MAX_TOKENS`` generated tokens, greedy, ``ignore_eos``; so requests/s is one unit of
engine work for both kinds. In order, in the same run:

1. **capacity**: ``max_num_seqs`` closed-loop clients calling ``CreateCompletion``
   (interactive) for a window; completed requests/s is what the engine can do. Then
   the same with ``StreamCompletion``: a stream costs the engine and the router a
   message per step, a whole answer two (``OUTPUT_KIND_FIRST_AND_FINAL``).
2. **interactive alone**: ``StreamCompletion`` arrivals at a fixed rate
   (``INTERACTIVE_SHARE`` of capacity, evenly spaced, open loop) for a window; time
   to first token is from sending to the first chunk (the router sends it with the first
   token, text or not). Every fourth arrival goes
   straight to the engine instead, which splits the cost of a backlog into the
   engine's (bigger steps) and the router's (the dispatcher's jobs share its process).
3. **interactive + backlog**: a backlog (several windows' worth of work at full
   capacity) is queued through ``QueueRequests``, then the same arrivals run again, for
   two windows (as many first tokens as the two alone windows hold together).
   Drain rate = jobs the queue store marks done during the window (read from the
   router's SQLite file, read-only). Share of free capacity = drain rate /
   (capacity - interactive rate achieved), the target's measure. The arrivals stream,
   which costs more than the whole answers capacity is measured with; a second share
   counts each at that cost (capacity / streaming capacity), which leaves less free.
   The engine's ``/metrics`` before and after each window say how busy it was, how
   full its steps were and whose tokens it made; ``/proc`` says how many cores each
   process kept busy (the engine's loop process counted with its server).
4. **interactive alone again**: the rest of the backlog is cancelled and, once the jobs
   it had started end, the arrivals of 2 run once more. The baseline of the TTFT ratios
   is both alone windows' first tokens together: these CPUs' speed drifts over minutes,
   and a baseline on both sides of the backlog's window cancels a steady drift. Each TTFT
   ratio comes with a bootstrap 90% interval: how far it could move with other requests of
   the same conditions (a p99 rests on a run's few slowest first tokens).
5. **submission**: ``SUBMIT_REQUESTS`` requests through ``QueueRequests`` in batches of
   ``SUBMIT_BATCH`` from ``SUBMITTERS`` concurrent callers, while the dispatcher keeps
   draining; requests/s is requests over wall time. The router's resident set size
   (``VmRSS``; the dispatcher runs inside the router) is read before and after.

Everything shares the machine's cores (on the 2-core dev box, with whatever else runs
there), so the engine's step time grows with its batch: that, not the dispatcher, is
what a CPU run's interactive ratio mostly shows.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sqlite3
import statistics
import tempfile
import time
import urllib.request
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from bench.progress import progress
from bench.service_chain_bench import MODEL_ID, _Services
from cachet.common.v1 import common_pb2
from cachet.engine.v1 import engine_pb2, engine_pb2_grpc
from cachet.engine_layout import available_cores, plan_engine_layout
from cachet.event_loop_lag import LAG_BUCKETS, EventLoopLagMonitor
from cachet.loopback_port import free_loopback_port
from cachet.models.catalog import ensure_model
from cachet.models.tiny import write_tiny_model
from cachet.router.v1 import router_pb2, router_pb2_grpc

PROMPT_TOKENS = 40  # two full blocks and a partial one
MAX_TOKENS = 16
MAX_NUM_SEQS = 32
INTERACTIVE_SHARE = 0.3  # of measured capacity
# Token ids drawn from the tiny model's (SmolLM2) ordinary vocabulary, past the specials.
TOKEN_RANGE = (1_000, 40_000)
SUBMIT_BATCH = 1_000  # the router's default queue_max_batch_requests
SUBMITTERS = 4

TTFT_RATIO_TARGET = 1.1
FREE_CAPACITY_SHARE_TARGET = 0.9
SUBMISSION_RATE_TARGET = 1_000.0


@dataclass(frozen=True)
class Scale:
    window_seconds: float
    submit_requests: int


FULL = Scale(window_seconds=30.0, submit_requests=100_000)
QUICK = Scale(window_seconds=8.0, submit_requests=20_000)
# A real model on a CPU finishes a few requests a second (SmolLM2-135M: about 10 on the dev
# box): 90 s windows hold some 250 interactive requests, enough for a p99.
REAL_MODEL_WINDOW_SECONDS = 90.0
_CANCELLED_BACKLOG_TIMEOUT_SECONDS = 120.0


@dataclass(frozen=True)
class _Workload:
    """The bench's requests: ``PROMPT_TOKENS`` random ids and ``MAX_TOKENS`` greedy tokens, for ``model``."""

    model: str
    rng: random.Random

    def completion(self) -> router_pb2.CompletionRequest:
        prompt = [self.rng.randrange(*TOKEN_RANGE) for _ in range(PROMPT_TOKENS)]
        sampling = common_pb2.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
        return router_pb2.CompletionRequest(model=self.model, prompt_token_ids=prompt, sampling=sampling)

    def queue_request(self, count: int) -> router_pb2.QueueRequestsRequest:
        return router_pb2.QueueRequestsRequest(
            model=self.model,
            requests=[router_pb2.QueuedRequest(completion=self.completion()) for _ in range(count)],
        )


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def _jobs_in(queue_file: Path, *states: str) -> int:
    """Jobs in any of ``states``, read from the router's queue file (read-only)."""
    marks = ", ".join("?" * len(states))
    with sqlite3.connect(f"file:{queue_file}?mode=ro", uri=True) as db:
        return db.execute(f"SELECT COUNT(*) FROM jobs WHERE state IN ({marks})", states).fetchone()[0]


async def _cancel_backlog(stub, batch_ids: list[str], queue_file: Path) -> None:
    """Cancel every batch, then wait for the jobs already started to finish: the engine is left
    with no queued work at all."""
    for batch_id in batch_ids:
        await stub.CancelQueuedBatch(router_pb2.CancelQueuedBatchRequest(request_id=batch_id), timeout=60)
    # Started jobs are at most the engine's seats and its prefetch: seconds of work.
    deadline = time.monotonic() + _CANCELLED_BACKLOG_TIMEOUT_SECONDS
    while (unfinished := _jobs_in(queue_file, "queued", "leased")) > 0:
        if time.monotonic() > deadline:
            raise RuntimeError(f"{unfinished} started jobs still unfinished after the backlog was cancelled")
        await asyncio.sleep(0.5)


async def _drain_rate(queue_file: Path, window) -> float:
    """Queued jobs finished per second while ``window`` (an awaitable) runs."""
    done_before = _jobs_in(queue_file, "done")
    started = time.perf_counter()
    await window
    return (_jobs_in(queue_file, "done") - done_before) / (time.perf_counter() - started)


def _cpu_seconds(pid: int, *, children: bool = True) -> float:
    """User + system CPU time of a process (all its threads) so far, and with ``children`` of
    its live children too (the engine's loop process)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    own = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    if not children:
        return own
    child_pids = [
        int(child)
        for task in Path(f"/proc/{pid}/task").iterdir()
        for child in (task / "children").read_text().split()
    ]
    return own + sum(_cpu_seconds(child) for child in child_pids)


def _cpu_by_process(pids: dict[str, int]) -> dict[str, float]:
    # This process's children are the services, counted on their own.
    return {name: _cpu_seconds(pid, children=pid != os.getpid()) for name, pid in pids.items()}


def _keyed(families: Iterable[Metric], prefix: str = "") -> dict[str, float]:
    """``name{label=value,...}`` -> value for every sample of the families named ``prefix``..."""
    return {
        sample.name + "".join(f"{{{k}={v}}}" for k, v in sorted(sample.labels.items())): sample.value
        for family in families
        if family.name.startswith(prefix)
        for sample in family.samples
    }


def _engine_figures(port: int, prefix: str = "cachet_engine_") -> dict[str, float]:
    """A service's figures from its /metrics (the engine's by default)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    return _keyed(text_string_to_metric_families(text), prefix)


# A due callback run later than this counts as late: a few ms is what one step's outputs cost
# a busy loop; ten is a tenth of a p99 time to first token.
LATE_TICK_SECONDS = 0.01


# This process's own loop: it sends the arrivals and times their first tokens, so a late tick
# here is time a TTFT figure spent in the measuring client, on the same cores.
_CLIENT_REGISTRY = CollectorRegistry()
_CLIENT_LOOP_LAG = Histogram(
    "bench_client_event_loop_lag_seconds",
    "The bench client's loop lag.",
    buckets=LAG_BUCKETS,
    registry=_CLIENT_REGISTRY,
)


def _client_figures() -> dict[str, float]:
    return _keyed(_CLIENT_REGISTRY.collect())


def _loop_lag(before: dict[str, float], after: dict[str, float], histogram: str) -> dict[str, float]:
    """Mean lag (ms) of a service's event loop over a window, and the share of its ticks that
    ran more than ``LATE_TICK_SECONDS`` late, from the growth of its lag histogram."""

    def grew(key: str) -> float:
        return after.get(key, 0.0) - before.get(key, 0.0)

    ticks = grew(f"{histogram}_count")
    on_time = grew(f"{histogram}_bucket{{le={LATE_TICK_SECONDS}}}")
    return {
        "mean_ms": 1000 * grew(f"{histogram}_sum") / ticks if ticks else 0.0,
        "late_share": (ticks - on_time) / ticks if ticks else 0.0,
    }


async def _engine_window(
    metrics_port: int, router_metrics_port: int, pids: dict[str, int], window
) -> tuple[Any, dict[str, float]]:
    """``window``'s result and what the engine did meanwhile (from its /metrics): how busy it
    was, how full its steps were, whose tokens it generated, how often batch work lost a seat;
    how late the router's, the engine server's and this client's event loops ran what was due; and the cores
    each process (``pids``: name -> pid) kept busy, the shared machine's split."""
    before = await asyncio.to_thread(_engine_figures, metrics_port)
    router_before = await asyncio.to_thread(_engine_figures, router_metrics_port, "cachet_router_event")
    client_before = _client_figures()
    cpu_before = _cpu_by_process(pids)
    started = time.perf_counter()
    result = await window
    elapsed = time.perf_counter() - started
    cpu_after = _cpu_by_process(pids)
    after = await asyncio.to_thread(_engine_figures, metrics_port)
    router_after = await asyncio.to_thread(_engine_figures, router_metrics_port, "cachet_router_event")
    client_after = _client_figures()
    lags = {
        "client": _loop_lag(client_before, client_after, "bench_client_event_loop_lag_seconds"),
        "router": _loop_lag(router_before, router_after, "cachet_router_event_loop_lag_seconds"),
        "engine_server": _loop_lag(before, after, "cachet_engine_event_loop_lag_seconds"),
    }

    def grew(key: str) -> float:
        return after.get(key, 0.0) - before.get(key, 0.0)

    steps = grew("cachet_engine_steps_total")
    return result, {
        "busy_share": grew("cachet_engine_step_duration_seconds_sum") / elapsed,
        "steps_per_s": steps / elapsed,
        "mean_step_ms": 1000
        * grew("cachet_engine_step_duration_seconds_sum")
        / max(grew("cachet_engine_step_duration_seconds_count"), 1),
        "mean_requests_per_step": grew("cachet_engine_scheduled_requests_total") / max(steps, 1),
        "interactive_tokens_per_s": grew("cachet_engine_generated_tokens_total{priority=interactive}")
        / elapsed,
        "batch_tokens_per_s": grew("cachet_engine_generated_tokens_total{priority=batch}") / elapsed,
        "seat_preemptions": grew("cachet_engine_preemptions_total{reason=seat}"),
        # What batch work may spend of a step beside interactive work as the window ended.
        "batch_token_budget": after.get("cachet_engine_batch_token_budget", 0.0),
        "kv_preemptions": grew("cachet_engine_preemptions_total{reason=kv_cache}"),
    } | {
        f"loop_lag_{name}_{figure}": value for name, lag in lags.items() for figure, value in lag.items()
    } | {f"cores_{name}": (cpu_after[name] - cpu_before[name]) / elapsed for name in pids}


def _percentile(ordered: list[float], share: float) -> float:
    return ordered[min(len(ordered) - 1, int(len(ordered) * share))]


def _ratio_interval(
    loaded: list[float], alone: list[float], share: float, draws: int = 1_000, coverage: float = 0.9
) -> tuple[float, float]:
    """A bootstrap interval of ``share``'s percentile, loaded over alone: how far this run's ratio
    could move with other requests of the same two conditions. A p99 of a few hundred first
    tokens is their third or fourth slowest, so one slow request moves it."""
    if not loaded or not alone:
        return (0.0, 0.0)
    rng = random.Random(0)  # the same samples give the same interval
    ratios = sorted(
        _percentile(sorted(rng.choices(loaded, k=len(loaded))), share)
        / _percentile(sorted(rng.choices(alone, k=len(alone))), share)
        for _ in range(draws)
    )
    tail = (1.0 - coverage) / 2
    return ratios[int(draws * tail)], ratios[min(draws - 1, int(draws * (1.0 - tail)))]


async def measure_capacity(
    stub, seconds: float, clients: int, workload: _Workload, *, stream: bool = False
) -> float:
    """Completed requests/s with ``clients`` closed-loop callers keeping the engine full."""
    done = 0
    deadline = time.perf_counter() + seconds

    async def client() -> None:
        nonlocal done
        while time.perf_counter() < deadline:
            if stream:
                async for _ in stub.StreamCompletion(workload.completion(), timeout=120):
                    pass
            else:
                await stub.CreateCompletion(workload.completion(), timeout=120)
            if time.perf_counter() <= deadline:
                done += 1

    started = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(clients)))
    return done / (time.perf_counter() - started) if done else 0.0


@dataclass(frozen=True)
class Arrivals:
    """One window of interactive arrivals: every first token's wait (ms), by path."""

    router_ms: list[float]
    engine_ms: list[float]
    requests: int
    failures: list[str]
    seconds: float

    def pooled(self, other: Arrivals) -> Arrivals:
        """Two windows of the same condition as one sample."""
        return Arrivals(
            self.router_ms + other.router_ms,
            self.engine_ms + other.engine_ms,
            self.requests + other.requests,
            self.failures + other.failures,
            self.seconds + other.seconds,
        )

    def summary(self) -> dict[str, Any]:
        router, direct = sorted(self.router_ms), sorted(self.engine_ms)
        return {
            "requests": self.requests,
            "failed": len(self.failures),
            "failures": dict(Counter(self.failures).most_common()),
            "requests_per_s": (len(router) + len(direct)) / self.seconds,
            "ttft_p50_ms": statistics.median(router),
            "ttft_p99_ms": _percentile(router, 0.99),
            "engine_direct_ttft_p50_ms": statistics.median(direct),
            "engine_direct_ttft_p99_ms": _percentile(direct, 0.99),
            "window_s": self.seconds,
        }


async def interactive_arrivals(stub, engine, rate: float, seconds: float, workload: _Workload) -> Arrivals:
    """Evenly spaced streaming arrivals at ``rate``/s for ``seconds``.

    Every fourth arrival goes straight to the engine (``Generate``, interactive priority)
    instead of through the router: what the engine alone adds to the first token, apart
    from what the router process (where the dispatcher's jobs run too) adds.
    """
    ttfts: dict[str, list[float]] = {"router": [], "engine": []}
    failures: list[str] = []

    def stream(path: str):
        if path == "router":
            return stub.StreamCompletion(workload.completion(), timeout=120)
        completion = workload.completion()
        return engine.Generate(
            engine_pb2.GenerateRequest(
                request_id=f"bench-{workload.rng.getrandbits(64):016x}",
                model=workload.model,
                prompt_token_ids=completion.prompt_token_ids,
                sampling=completion.sampling,
                priority=common_pb2.PRIORITY_INTERACTIVE,
            ),
            timeout=120,
        )

    async def one(path: str) -> None:
        sent = time.perf_counter()
        try:
            first = True
            async for _ in stream(path):
                if first:
                    ttfts[path].append((time.perf_counter() - sent) * 1000)
                    first = False
        except grpc.aio.AioRpcError as error:
            # Which path, and the status's words: they name who refused (the router's placement,
            # an engine's queue) where the code alone does not.
            failures.append(f"{path}: {error.code().name}: {error.details()}")

    started = time.perf_counter()
    tasks = []
    for index in range(int(rate * seconds)):
        await asyncio.sleep(max(0.0, started + index / rate - time.perf_counter()))
        tasks.append(asyncio.create_task(one("engine" if index % 4 == 3 else "router")))
    await asyncio.gather(*tasks)
    return Arrivals(ttfts["router"], ttfts["engine"], len(tasks), failures, time.perf_counter() - started)


async def fill_queue(
    stub, requests: int, workload: _Workload, batch_ids: list[str] | None = None
) -> dict[str, float]:
    """``requests`` through QueueRequests from ``SUBMITTERS`` callers; batches built before timing.
    ``batch_ids``, when given, gets each queued batch's id."""
    batches = [
        workload.queue_request(min(SUBMIT_BATCH, requests - i)) for i in range(0, requests, SUBMIT_BATCH)
    ]
    pending = list(reversed(batches))

    async def submitter() -> None:
        while pending:
            reply = await stub.QueueRequests(pending.pop(), timeout=120)
            assert reply.status == router_pb2.BATCH_STATUS_QUEUED, reply
            if batch_ids is not None:
                batch_ids.append(reply.request_id)

    started = time.perf_counter()
    await asyncio.gather(*(submitter() for _ in range(SUBMITTERS)))
    elapsed = time.perf_counter() - started
    return {"requests": requests, "seconds": elapsed, "requests_per_s": requests / elapsed}


@dataclass
class _Watch:
    """What the windows run against, and the engine's figures of each watched window by name."""

    stub: Any
    engine: Any
    workload: _Workload
    window: float
    engine_metrics_port: int
    router_metrics_port: int
    pids: dict[str, int]
    queue_file: Path
    engine_windows: dict[str, dict[str, float]] = field(default_factory=dict)

    async def watched(self, name: str, window):
        result, self.engine_windows[name] = await _engine_window(
            self.engine_metrics_port, self.router_metrics_port, self.pids, window
        )
        return result

    def arrivals(self, rate: float, seconds: float):
        return interactive_arrivals(self.stub, self.engine, rate, seconds, self.workload)


@dataclass(frozen=True)
class _Capacity:
    closed_loop: float
    streaming: float


@dataclass(frozen=True)
class _BacklogWindows:
    """Windows 3 to 6: interactive arrivals alone, the backlog alone, both, arrivals alone again."""

    alone_before: Arrivals
    with_backlog: Arrivals
    alone_after: Arrivals
    backlog: int
    drain_alone: float
    drain_rate: float


async def measure(
    router: str,
    engine_address: str,
    engine_metrics_port: int,
    router_metrics_port: int,
    pids: dict[str, int],
    queue_file: Path,
    scale: Scale,
    model_id: str,
) -> dict[str, Any]:
    """``pids``: each service's process by name ("router" among them); this one is added."""
    async with (
        grpc.aio.insecure_channel(router) as channel,
        grpc.aio.insecure_channel(engine_address) as engine_channel,
    ):
        watch = _Watch(
            router_pb2_grpc.InferenceServiceStub(channel),
            engine_pb2_grpc.EngineServiceStub(engine_channel),
            _Workload(model_id, random.Random(0)),
            scale.window_seconds,
            engine_metrics_port,
            router_metrics_port,
            pids | {"bench": os.getpid()},
            queue_file,
        )
        client_loop_lag = EventLoopLagMonitor(_CLIENT_LOOP_LAG)
        client_loop_lag.start()
        await _warm_up(watch)
        capacity = await _capacity_windows(watch)
        rate = INTERACTIVE_SHARE * capacity.closed_loop
        windows = await _backlog_windows(watch, rate, capacity)
        submission = await _submission(watch, scale.submit_requests, pids["router"])
        client_loop_lag.stop()
    return _result(watch, capacity, rate, windows, submission)


async def _warm_up(watch: _Watch) -> None:
    progress(f"  warm-up: 1 to {MAX_NUM_SEQS} closed-loop clients")
    # Every batch size once (a GPU engine's first step at a new size is slow).
    for clients in range(1, MAX_NUM_SEQS + 1):
        await measure_capacity(watch.stub, 0.2, clients, watch.workload)


async def _capacity_windows(watch: _Watch) -> _Capacity:
    """Windows 1 and 2: what the engine completes with every seat taken, whole answers then streams."""
    window = watch.window
    progress(f"  window 1/6, {window:.0f} s: capacity, {MAX_NUM_SEQS} closed-loop clients")
    capacity = await watch.watched(
        "capacity", measure_capacity(watch.stub, window, MAX_NUM_SEQS, watch.workload)
    )
    progress(f"    {capacity:.1f} req/s; window 2/6, {window:.0f} s: the same clients streaming")
    streaming = await measure_capacity(watch.stub, window, MAX_NUM_SEQS, watch.workload, stream=True)
    return _Capacity(capacity, streaming)


async def _backlog_windows(watch: _Watch, rate: float, capacity: _Capacity) -> _BacklogWindows:
    window = watch.window
    progress(
        f"    {capacity.streaming:.1f} req/s; window 3/6, {window:.0f} s: interactive arrivals alone,"
        f" {rate:.1f}/s"
    )
    alone_before = await watch.watched("interactive_alone", watch.arrivals(rate, window))

    # Enough work that the queue cannot run dry during its windows, even at full capacity.
    backlog = max(5_000, int(capacity.closed_loop * window * 4))
    progress(
        f"    TTFT p50 {alone_before.summary()['ttft_p50_ms']:.1f} ms; queueing a backlog of {backlog} requests"
    )
    backlog_batches: list[str] = []
    await fill_queue(watch.stub, backlog, watch.workload, backlog_batches)
    await asyncio.sleep(2.0)  # the dispatcher reaches its steady state
    progress(f"  window 4/6, {window:.0f} s: the backlog draining alone")
    drain_alone = await watch.watched("drain_alone", _drain_rate(watch.queue_file, asyncio.sleep(window)))
    progress(
        f"    {drain_alone:.1f} req/s; window 5/6, {2 * window:.0f} s: interactive arrivals beside the backlog"
    )
    # Twice an alone window: the TTFT baseline pools two of those, and its p99 and this one's
    # then rest on as many first tokens.
    with_backlog_run = asyncio.ensure_future(watch.arrivals(rate, 2 * window))
    drain_rate = await watch.watched(
        "interactive_with_backlog", _drain_rate(watch.queue_file, with_backlog_run)
    )
    with_backlog = with_backlog_run.result()
    progress(f"    TTFT p50 {with_backlog.summary()['ttft_p50_ms']:.1f} ms, drain {drain_rate:.1f} req/s")

    # The same arrivals alone once more, after the backlog: these CPUs' speed drifts over
    # minutes, and a baseline on both sides of the backlog's window cancels a steady drift.
    progress("  cancelling the rest of the backlog; waiting for its started jobs")
    await _cancel_backlog(watch.stub, backlog_batches, watch.queue_file)
    progress(f"  window 6/6, {window:.0f} s: interactive arrivals alone again")
    alone_after = await watch.watched("interactive_alone_after", watch.arrivals(rate, window))
    progress(f"    TTFT p50 {alone_after.summary()['ttft_p50_ms']:.1f} ms")
    return _BacklogWindows(alone_before, with_backlog, alone_after, backlog, drain_alone, drain_rate)


async def _submission(watch: _Watch, requests: int, router_pid: int) -> dict[str, Any]:
    """Window 7: ``requests`` through QueueRequests, and the router's memory around them."""
    rss_before = _rss_mib(router_pid)
    progress(f"  submitting {requests} requests through QueueRequests")
    submission = await fill_queue(watch.stub, requests, watch.workload)
    rss_after = _rss_mib(router_pid)
    await asyncio.sleep(2.0)
    return {
        "submission": submission,
        "router_rss_mib_before": rss_before,
        "router_rss_mib_after": rss_after,
        "router_rss_mib_settled": _rss_mib(router_pid),
    }


def _ttft_ratios(loaded_run: Arrivals, alone_run: Arrivals) -> dict[str, Any]:
    """Loaded over alone at p50 and p99, through the router and straight to the engine, with intervals."""
    loaded, alone = loaded_run.summary(), alone_run.summary()
    measures = [
        (f"{prefix}ttft_{percentile}", samples, share)
        for prefix, samples in (("", "router_ms"), ("engine_direct_", "engine_ms"))
        for percentile, share in (("p50", 0.5), ("p99", 0.99))
    ]
    ratios = {f"{name}_ratio": loaded[f"{name}_ms"] / alone[f"{name}_ms"] for name, _, _ in measures}
    intervals = {
        f"{name}_ratio_interval": _ratio_interval(
            getattr(loaded_run, samples), getattr(alone_run, samples), share
        )
        for name, samples, share in measures
    }
    return ratios | intervals


def _result(
    watch: _Watch, capacity: _Capacity, rate: float, windows: _BacklogWindows, submission: dict[str, Any]
) -> dict[str, Any]:
    alone_run = windows.alone_before.pooled(windows.alone_after)
    with_backlog = windows.with_backlog.summary()
    # The larger of two measures of the engine's capacity: the closed loop pays for this
    # process's client work on the shared cores, the queue alone for the headroom rule.
    capacity_used = max(capacity.closed_loop, windows.drain_alone)
    free_capacity = capacity_used - with_backlog["requests_per_s"]
    # The interactive arrivals stream, and a stream costs the engine and the router more
    # than a whole answer (a message per step): counted at that cost, they leave less free.
    stream_cost = capacity.closed_loop / capacity.streaming if capacity.streaming else 1.0
    free_at_stream_cost = capacity_used - with_backlog["requests_per_s"] * stream_cost
    drain_rate = windows.drain_rate
    return {
        "prompt_tokens": PROMPT_TOKENS,
        "max_tokens": MAX_TOKENS,
        "engine_max_num_seqs": MAX_NUM_SEQS,
        "window_s": watch.window,
        "capacity_closed_loop_requests_per_s": capacity.closed_loop,
        "capacity_streaming_requests_per_s": capacity.streaming,
        "drain_alone_requests_per_s": windows.drain_alone,
        "capacity_requests_per_s": capacity_used,
        "interactive_rate_per_s": rate,
        "interactive_alone": alone_run.summary(),
        "interactive_alone_before": windows.alone_before.summary(),
        "interactive_alone_after": windows.alone_after.summary(),
        "interactive_with_backlog": with_backlog,
        "backlog_requests": windows.backlog,
        **_ttft_ratios(windows.with_backlog, alone_run),
        "drain_requests_per_s": drain_rate,
        "free_capacity_requests_per_s": free_capacity,
        "free_capacity_share": drain_rate / free_capacity if free_capacity > 0 else 0.0,
        "free_capacity_at_stream_cost_requests_per_s": free_at_stream_cost,
        "free_capacity_at_stream_cost_share": drain_rate / free_at_stream_cost
        if free_at_stream_cost > 0
        else 0.0,
        **submission,
        "engine_windows": watch.engine_windows,
    }


def _real_model_threads(model: str | None, device: str) -> dict[str, str]:
    """A real model's engine gets the math threads ``make run-local`` would give it (every core
    of a one-replica host). ``_Services`` starts each process with one, as the tests run them:
    the queue bench's engine then kept one core of two busy (1.02-1.04 in its figures), and on a
    Zen 4 EPYC its capacity read 13.2 requests/s against 18.6 with both. The tiny model's steps
    are too small to need more."""
    if model is None or device != "cpu":
        return {}
    layout = plan_engine_layout(cores=available_cores(), gpus=0, ranks_per_replica=1, replicas=1)
    return {"CACHET_ENGINE_THREADS": str(layout.threads_per_rank)}


def run_queue_bench(
    quick: bool = False,
    router_env: dict[str, str] | None = None,
    engine_device: str = "cpu",
    vocab_from: Path | None = None,
    engine_env: dict[str, str] | None = None,
    model: str | None = None,
    window_seconds: float | None = None,
) -> dict[str, Any]:
    """``router_env`` and ``engine_env`` override those services' variables (the headroom knobs,
    the scheduler's); ``vocab_from`` is a Hugging Face directory to take the tokenizer from
    where the default model's GGUF is not installed. ``model`` (an id or checkpoint dir) serves a
    real model instead of the tiny one: a CPU runs it at a few requests a second, so its figures
    rest on fewer requests, but its steps cost what serving it costs."""
    print(
        f"[bench] async queue ({model or 'tiny model'}; tokenizer, usage, cache, engine, router processes)",
        flush=True,
    )
    scale = QUICK if quick else FULL
    if window_seconds is not None:
        # A real model on a CPU finishes a few requests a second: a p99 needs longer windows.
        scale = Scale(window_seconds=window_seconds, submit_requests=scale.submit_requests)
    with tempfile.TemporaryDirectory(prefix="cachet-queue-bench-") as directory:
        root = Path(directory)
        if model is None:
            model_dir, model_id = write_tiny_model(root / MODEL_ID, vocab_from=vocab_from), MODEL_ID
        else:
            resolved = ensure_model(model, Path(os.environ.get("CACHET_DATA_DIR", "data")))
            model_dir, model_id = resolved.path, resolved.model_id
        services = _Services(root)
        try:
            tokenizer = services.start("tokenizer", {"CACHET_TOKENIZER_MODELS": json.dumps([str(model_dir)])})
            usage = services.start("usage", {"CACHET_DATA_DIR": str(root / "usage-data")})
            engine_metrics_port = free_loopback_port()
            engine = services.start(
                "engine",
                {
                    "CACHET_MODEL": str(model_dir),
                    "CACHET_ENGINE_MAX_NUM_SEQS": str(MAX_NUM_SEQS),
                    "CACHET_DEVICE": engine_device,
                    "CACHET_ENGINE_METRICS_PORT": str(engine_metrics_port),
                }
                | _real_model_threads(model, engine_device)
                | (engine_env or {}),
            )
            router_metrics_port = free_loopback_port()
            cache = services.start("cache", {"CACHET_CACHE_ENGINE_ADDRESSES": json.dumps([engine])})
            router = services.start(
                "router",
                {
                    "CACHET_ROUTER_TOKENIZER_ADDRESS": tokenizer,
                    "CACHET_ROUTER_USAGE_ADDRESS": usage,
                    "CACHET_ROUTER_CACHE_ADDRESS": cache,
                    "CACHET_ROUTER_ENGINE_ADDRESSES": json.dumps([engine]),
                    "CACHET_DATA_DIR": str(root / "router-data"),
                    "CACHET_ROUTER_METRICS_PORT": str(router_metrics_port),
                }
                | (router_env or {}),
            )
            pids = {
                name: process.pid
                for name, process in zip(
                    ("tokenizer", "usage", "engine", "cache", "router"), services.processes, strict=True
                )
            }
            queue_file = root / "router-data" / "queue.sqlite3"
            result = asyncio.run(
                measure(
                    router,
                    engine,
                    engine_metrics_port,
                    router_metrics_port,
                    pids,
                    queue_file,
                    scale,
                    model_id,
                )
            )
            result["engine_device"] = engine_device
            result["model"] = model_id
            result["router_refusals"] = _refusal_lines(root / "router.log")
        finally:
            services.stop()
    _print(result)
    return result


# The router's words for each request it turned away: which replica refused, with what code, and
# the load it saw. A failed request in the table is otherwise a status and no cause.
_REFUSAL_EVENTS = ("engine refused request", "every replica at capacity")


def _refusal_lines(router_log: Path, limit: int = 20) -> list[str]:
    if not router_log.exists():
        return []
    lines = [
        line
        for line in router_log.read_text(errors="replace").splitlines()
        if any(event in line for event in _REFUSAL_EVENTS)
    ]
    return lines[:limit]


def _print(result: dict[str, Any]) -> None:
    print(
        f"\nAsync queue: one engine (max_num_seqs {result['engine_max_num_seqs']}), requests of"
        f" {result['prompt_tokens']} prompt + {result['max_tokens']} generated tokens,"
        f" {result['window_s']:.0f} s windows, {result['model']}"
    )
    _print_interactive(result)
    _print_capacity(result)
    windows = result["engine_windows"]
    _print_engine_windows(windows)
    _print_cores(windows)
    _print_loop_lags(windows)


def _print_interactive(result: dict[str, Any]) -> None:
    """First tokens alone and beside the backlog, their ratios against the targets, and what failed."""
    alone, loaded = result["interactive_alone"], result["interactive_with_backlog"]
    print(f"{'measure':<50}{'alone':>12}{'w/ backlog':>12}{'ratio':>10}{'90% interval':>16}{'target':>10}")
    print("-" * 110)
    for name, key, ratio in (
        ("interactive TTFT p50 (ms)", "ttft_p50_ms", "ttft_p50_ratio"),
        ("interactive TTFT p99 (ms)", "ttft_p99_ms", "ttft_p99_ratio"),
        ("  straight to the engine, p50 (ms)", "engine_direct_ttft_p50_ms", "engine_direct_ttft_p50_ratio"),
        ("  straight to the engine, p99 (ms)", "engine_direct_ttft_p99_ms", "engine_direct_ttft_p99_ratio"),
    ):
        low, high = result[f"{ratio}_interval"]
        print(
            f"{name:<50}{alone[key]:>12.1f}{loaded[key]:>12.1f}{result[ratio]:>10.2f}"
            f"{f'{low:.2f}-{high:.2f}':>16}{'<= ' + str(TTFT_RATIO_TARGET):>10}"
        )
    before, after = result["interactive_alone_before"], result["interactive_alone_after"]
    print(
        f"  alone before / after the backlog: TTFT p50 {before['ttft_p50_ms']:.1f} / {after['ttft_p50_ms']:.1f} ms,"
        f" p99 {before['ttft_p99_ms']:.1f} / {after['ttft_p99_ms']:.1f} ms"
    )
    print(f"{'interactive requests/s (failed)':<50}", end="")
    print(
        f"{alone['requests_per_s']:>8.1f} ({alone['failed']}){loaded['requests_per_s']:>8.1f} ({loaded['failed']})"
    )
    for window, figures in (("alone", alone), ("with backlog", loaded)):
        for failure, count in figures["failures"].items():
            print(f"  failed {window}, {count}x: {failure}")
    for line in result.get("router_refusals", []):
        print(f"  router: {line}")


def _print_capacity(result: dict[str, Any]) -> None:
    """Capacity, the drain's share of what interactive traffic leaves free, submission and memory."""
    print(f"\n{'measure':<50}{'value':>12}{'target':>14}")
    print("-" * 76)
    rows = (
        ("capacity, closed loop (requests/s)", f"{result['capacity_closed_loop_requests_per_s']:.1f}", ""),
        (
            "  same, streaming clients (requests/s)",
            f"{result['capacity_streaming_requests_per_s']:.1f}",
            "",
        ),
        ("capacity, backlog drain alone (requests/s)", f"{result['drain_alone_requests_per_s']:.1f}", ""),
        ("free capacity with interactive (requests/s)", f"{result['free_capacity_requests_per_s']:.1f}", ""),
        (
            f"backlog drain (requests/s, {result['backlog_requests']} queued)",
            f"{result['drain_requests_per_s']:.1f}",
            "",
        ),
        (
            "share of free capacity drained",
            f"{result['free_capacity_share']:.2f}",
            f">= {FREE_CAPACITY_SHARE_TARGET}",
        ),
        (
            "  same, interactive streams at their cost",
            f"{result['free_capacity_at_stream_cost_share']:.2f}",
            "",
        ),
        (
            f"QueueRequests submission ({result['submission']['requests']} req, requests/s)",
            f"{result['submission']['requests_per_s']:.0f}",
            f"> {SUBMISSION_RATE_TARGET:.0f}",
        ),
        ("router RSS before filling (MiB)", f"{result['router_rss_mib_before']:.1f}", ""),
        ("router RSS after filling (MiB)", f"{result['router_rss_mib_after']:.1f}", "flat"),
        ("router RSS 2 s later (MiB)", f"{result['router_rss_mib_settled']:.1f}", ""),
    )
    for name, value, target in rows:
        print(f"{name:<50}{value:>12}{target:>14}")


def _print_engine_windows(windows: dict[str, dict[str, float]]) -> None:
    _print_windows(
        "The engine in each window (its /metrics)",
        ("busy", "steps/s", "step ms", "req/step", "int tok/s", "batch tok/s", "seat pre.", "batch cap"),
        {
            name: (
                f"{figures['busy_share']:.2f}",
                f"{figures['steps_per_s']:.0f}",
                f"{figures['mean_step_ms']:.1f}",
                f"{figures['mean_requests_per_step']:.1f}",
                f"{figures['interactive_tokens_per_s']:.0f}",
                f"{figures['batch_tokens_per_s']:.0f}",
                f"{figures['seat_preemptions']:.0f}",
                f"{figures['batch_token_budget']:.0f}",
            )
            for name, figures in windows.items()
        },
    )


def _print_cores(windows: dict[str, dict[str, float]]) -> None:
    names = [key.removeprefix("cores_") for key in next(iter(windows.values())) if key.startswith("cores_")]

    def cores(figures: dict[str, float]) -> tuple[str, ...]:
        each = [figures[f"cores_{n}"] for n in names]
        return tuple(f"{c:.2f}" for c in (*each, sum(each)))

    _print_windows(
        f"Cores each process kept busy ({os.cpu_count()} on this machine)",
        (*names, "all"),
        {name: cores(figures) for name, figures in windows.items()},
    )


def _print_loop_lags(windows: dict[str, dict[str, float]]) -> None:
    loops = {"router": "router", "engine_server": "engine srv", "client": "client"}
    late = f"> {LATE_TICK_SECONDS * 1000:.0f} ms"
    _print_windows(
        "How late the event loops ran what was due (a tick every 50 ms; their lag histograms)",
        tuple(column for label in loops.values() for column in (f"{label} mean ms", late)),
        {
            name: tuple(
                value
                for loop in loops
                for value in (
                    f"{figures[f'loop_lag_{loop}_mean_ms']:.2f}",
                    f"{figures[f'loop_lag_{loop}_late_share']:.1%}",
                )
            )
            for name, figures in windows.items()
        },
        width=19,
    )


def _print_windows(
    title: str, columns: tuple[str, ...], rows: dict[str, tuple[str, ...]], width: int = 11
) -> None:
    """One table of per-window figures: a row per window, ``columns`` right-aligned."""
    print(f"\n{title}")
    print(f"{'window':<26}" + "".join(f"{c:>{width}}" for c in columns))
    print("-" * (26 + width * len(columns)))
    for name, values in rows.items():
        print(f"{name:<26}" + "".join(f"{v:>{width}}" for v in values))


# Overrides for the engine process rather than the router: its own knobs and its math threads.
ENGINE_VARIABLES = ("CACHET_ENGINE_", "OMP_NUM_THREADS", "MKL_NUM_THREADS")


def main() -> None:
    parser = argparse.ArgumentParser(description="the async queue bench on its own")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--engine-device", default="cpu", help="cpu, or cuda on a GPU machine")
    parser.add_argument("--vocab-from", type=Path, default=None, help="a Hugging Face dir with a tokenizer")
    parser.add_argument("--model", default=None, help="a real model's id or checkpoint dir (default: tiny)")
    parser.add_argument(
        "--window-seconds", type=float, default=None, help="each window's length (default: 30, quick 8)"
    )
    parser.add_argument(
        "overrides",
        nargs="*",
        help="KEY=VALUE variables of the router, or of the engine for CACHET_ENGINE_*, e.g."
        " CACHET_ROUTER_BATCH_MAX_IN_FLIGHT=8",
    )
    args = parser.parse_args()
    overrides = dict(pair.split("=", 1) for pair in args.overrides)
    engine_env = {key: value for key, value in overrides.items() if key.startswith(ENGINE_VARIABLES)}
    router_env = {key: value for key, value in overrides.items() if key not in engine_env}
    result = run_queue_bench(
        args.quick,
        router_env,
        args.engine_device,
        args.vocab_from,
        engine_env,
        args.model,
        args.window_seconds,
    )
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
