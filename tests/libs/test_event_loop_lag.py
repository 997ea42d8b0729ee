"""The event-loop lag histogram sees a loop held up, and nothing once stopped."""

from __future__ import annotations

import asyncio
import time

from prometheus_client import CollectorRegistry, Histogram

from cachet.event_loop_lag import LAG_BUCKETS, EventLoopLagMonitor


def lag_histogram() -> tuple[Histogram, CollectorRegistry]:
    registry = CollectorRegistry()
    histogram = Histogram("test_event_loop_lag_seconds", "lag", buckets=LAG_BUCKETS, registry=registry)
    return histogram, registry


def sample(registry: CollectorRegistry, name: str, **labels: str) -> float:
    value = registry.get_sample_value(name, labels)
    return 0.0 if value is None else value


async def test_a_blocked_loop_shows_as_lag() -> None:
    histogram, registry = lag_histogram()
    monitor = EventLoopLagMonitor(histogram, interval_seconds=0.01)
    monitor.start()
    await asyncio.sleep(0.1)
    idle_ticks = sample(registry, "test_event_loop_lag_seconds_count")
    time.sleep(0.2)  # a callback that holds the loop, as a long one in a service would
    await asyncio.sleep(0.05)
    monitor.stop()

    assert idle_ticks >= 3
    late = sample(registry, "test_event_loop_lag_seconds_count") - sample(
        registry, "test_event_loop_lag_seconds_bucket", le="0.1"
    )
    assert late >= 1, "the tick due during the 0.2 s block ran more than 0.1 s late"
    assert sample(registry, "test_event_loop_lag_seconds_sum") >= 0.15


async def test_stopped_monitor_observes_nothing() -> None:
    histogram, registry = lag_histogram()
    monitor = EventLoopLagMonitor(histogram, interval_seconds=0.01)
    started = time.monotonic()
    monitor.start()
    monitor.start()  # idempotent: one timer, not two
    await asyncio.sleep(0.05)
    monitor.stop()
    elapsed = time.monotonic() - started
    stopped_at = sample(registry, "test_event_loop_lag_seconds_count")
    await asyncio.sleep(0.05)

    # One timer ticks at most once per interval (two would tick twice as often).
    assert 1 <= stopped_at <= elapsed / 0.01 + 1
    assert sample(registry, "test_event_loop_lag_seconds_count") == stopped_at
