"""Prometheus figures of one engine replica (served on its ``metrics_port``, 9061 by default).

What the scheduler counts (tokens by priority and phase, preemptions by reason, finished
requests) and its queues come with each of the engine loop's step reports
(``EngineStats``); a collector reads the last one at scrape time, and the step-time
histogram is observed as each report arrives.
Each engine has a registry of its own: tests run several engines in one process.

Read together they answer what the load report cannot: how full the steps are
(``scheduled_requests_total`` over ``steps_total``), how much batch work ran beside
interactive work, and how often batch work gave up its seat.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TypeVar

from prometheus_client import CollectorRegistry, Histogram, Info
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from cachet.engine.async_engine import AsyncEngine
from cachet.engine.scheduler import PRIORITIES
from cachet.event_loop_lag import LAG_BUCKETS, EventLoopLagMonitor

_Family = TypeVar("_Family", GaugeMetricFamily, CounterMetricFamily)

# A step of the tiny test model is ~2 ms on one CPU core; of a large model on a GPU, tens of ms.
_STEP_SECONDS_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class SchedulerCollector(Collector):
    def __init__(self, engine: AsyncEngine) -> None:
        self._engine = engine

    def collect(self) -> Iterator[Metric]:
        # One report's figures (the loop's last), read whole: the loop may send the next meanwhile.
        stats = self._engine.stats
        counts = stats.counts
        yield _by_priority(
            GaugeMetricFamily(
                "cachet_engine_requests_running", "Requests holding a seat in the batch.", labels=["priority"]
            ),
            stats.running,
        )
        yield _by_priority(
            GaugeMetricFamily(
                "cachet_engine_requests_waiting",
                "Requests queued for a seat, preempted ones included.",
                labels=["priority"],
            ),
            stats.waiting,
        )
        yield GaugeMetricFamily(
            "cachet_engine_kv_blocks_free",
            "KV cache blocks no request holds.",
            value=stats.free_kv_blocks,
        )
        yield GaugeMetricFamily(
            "cachet_engine_kv_blocks", "KV cache blocks in the pool.", value=stats.total_kv_blocks
        )
        yield GaugeMetricFamily(
            "cachet_engine_kv_host_blocks_used",
            "Blocks the host KV tier holds (evicted from the pool, findable by prefix).",
            value=stats.host_kv_blocks,
        )
        yield GaugeMetricFamily(
            "cachet_engine_kv_host_blocks", "Blocks the host KV tier can hold.", value=stats.host_kv_slots
        )
        yield GaugeMetricFamily(
            "cachet_engine_batch_token_budget",
            "Most tokens of batch (async queue) work a step carries beside interactive work, from "
            "the step costs measured.",
            value=stats.batch_token_budget,
        )
        yield _by_label(
            CounterMetricFamily(
                "cachet_engine_prefix_cache_hit_tokens",
                "Prompt tokens served from a KV tier instead of computed (host: copied back; engine: "
                "pool hits, and last blocks copied from another live request, as n > 1 choices do; "
                "shared: the shared file tier; transfer: blocks a prefill replica pushed here).",
                labels=["tier"],
            ),
            stats.cached_tokens_by_tier,
        )
        yield _by_label(
            CounterMetricFamily(
                "cachet_engine_kv_block_copies",
                "KV blocks copied between the pool and the lower tiers (demote/promote: host tier; "
                "store/load: shared file tier; send: to another replica's KV receiver; receive: "
                "pushed into this replica's receiver, receive_dropped: dropped there unused past its "
                "budget), or within the pool (duplicate: a request's last block copied from another "
                "live request that computed it).",
                labels=["direction"],
            ),
            stats.kv_block_copies,
        )
        yield _by_label(
            CounterMetricFamily(
                "cachet_engine_kv_block_copy_bytes",
                "Bytes of KV copied on rank 0 (demote/promote: host tier; store/load: shared file "
                "tier, payload only; send: to another replica; receive, receive_dropped: from "
                "one; duplicate: within the pool).",
                labels=["direction"],
            ),
            stats.kv_block_copy_bytes,
        )
        yield _by_label(
            GaugeMetricFamily(
                "cachet_engine_kv_retained_blocks",
                "KV blocks under a live retention (prompt_cache_retention, cache_control, the "
                "session default): evicted after every other block of their tier.",
                labels=["tier"],
            ),
            stats.kv_retained_blocks,
        )
        yield CounterMetricFamily(
            "cachet_engine_kv_block_retentions",
            "KV blocks put under retention (or kept longer) as their requests ended.",
            value=stats.kv_block_retentions,
        )
        yield CounterMetricFamily(
            "cachet_engine_steps", "Forward passes with work in them.", value=counts.steps
        )
        yield CounterMetricFamily(
            "cachet_engine_scheduled_requests",
            "Sum over steps of the requests in each; divided by steps, the mean batch.",
            value=counts.scheduled_requests,
        )
        computed = CounterMetricFamily(
            "cachet_engine_computed_tokens",
            "Tokens run through the model; phase decode is a generating request's one token a step.",
            labels=["priority", "phase"],
        )
        for (priority, phase), tokens in counts.computed_tokens.items():
            computed.add_metric([priority, phase], tokens)
        yield computed
        yield _by_priority(
            CounterMetricFamily("cachet_engine_generated_tokens", "Tokens sampled.", labels=["priority"]),
            counts.generated_tokens,
        )
        preemptions = CounterMetricFamily(
            "cachet_engine_preemptions",
            "Running requests sent back to wait (recomputed later): the KV pool ran dry, or an "
            "interactive arrival took a batch request's seat.",
            labels=["reason"],
        )
        for reason, count in counts.preemptions.items():
            preemptions.add_metric([reason], count)
        yield preemptions
        finished = CounterMetricFamily(
            "cachet_engine_requests_finished", "Requests that ended, by how.", labels=["status"]
        )
        for status, count in counts.finished_requests.items():
            finished.add_metric([status.lower()], count)
        yield finished


def _by_priority(family: _Family, values: dict[str, int]) -> _Family:
    for priority in PRIORITIES:
        family.add_metric([priority], values[priority])
    return family


def _by_label(family: _Family, values: dict[str, int]) -> _Family:
    for label, value in values.items():
        family.add_metric([label], value)
    return family


class EngineMetrics:
    """The engine's registry: the scheduler collector, the step-time and event-loop lag histograms."""

    def __init__(self, engine: AsyncEngine, role: str = "mixed") -> None:
        self.registry = CollectorRegistry()
        self.registry.register(SchedulerCollector(engine))
        # The replica's part in disaggregated prefill, to group its figures by role in queries.
        Info(
            "cachet_engine_role", "This replica's role: mixed, prefill or decode.", registry=self.registry
        ).info({"role": role})
        self._step_seconds = Histogram(
            "cachet_engine_step_duration_seconds",
            "Wall time of one step: schedule, forward pass, sampling, bookkeeping.",
            buckets=_STEP_SECONDS_BUCKETS,
            registry=self.registry,
        )
        engine.on_step = self._step_seconds.observe
        # The server's loop carries every request's commands and outputs to and from the step loop.
        self.loop_lag = EventLoopLagMonitor(
            Histogram(
                "cachet_engine_event_loop_lag_seconds",
                "How late the engine server's event loop ran a callback that was due.",
                buckets=LAG_BUCKETS,
                registry=self.registry,
            )
        )
