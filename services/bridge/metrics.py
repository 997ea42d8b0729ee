"""The bridge's Prometheus metrics, in a registry per app.

A registry per app (not the process-global one) because tests build many apps in
one process, and a collector can be registered only once per registry.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from cachet.common.v1 import common_pb2

CONTENT_TYPE = CONTENT_TYPE_LATEST

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


@dataclass
class BridgeMetrics:
    registry: CollectorRegistry = field(default_factory=CollectorRegistry)

    def __post_init__(self) -> None:
        self.requests = Counter(
            "cachet_bridge_requests",
            "HTTP requests answered.",
            ["method", "route", "status"],
            registry=self.registry,
        )
        self.duration = Histogram(
            "cachet_bridge_request_duration_seconds",
            "Time from request to the last byte of the answer (whole stream included).",
            ["route"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.first_event = Histogram(
            "cachet_bridge_stream_first_event_seconds",
            "Time from request to the first SSE event (time to first token, as the client sees it).",
            ["route"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.tokens = Counter(
            "cachet_bridge_tokens", "Tokens of answered requests.", ["kind"], registry=self.registry
        )

    def observe_usage(self, usage: common_pb2.Usage) -> None:
        # cached is part of prompt (common.proto); both are counted so the hit rate is cached / prompt.
        self.tokens.labels("prompt").inc(usage.prompt_tokens)
        self.tokens.labels("cached").inc(usage.cached_tokens)
        self.tokens.labels("completion").inc(usage.completion_tokens)

    def render(self) -> bytes:
        return generate_latest(self.registry)
