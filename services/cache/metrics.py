"""Prometheus figures of the prefix index, read from it at scrape time.

A collector (not module-level Counter/Gauge objects) so the index stays a plain
class that tests build many times, and so a scrape sees one consistent reading.
"""

from __future__ import annotations

from collections.abc import Iterator
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from cachet.cache.followers import Followers
from cachet.cache.prefix_index import PrefixIndex
from cachet.config import LOOPBACK


class IndexCollector(Collector):
    def __init__(self, index: PrefixIndex, followers: Followers) -> None:
        self._index = index
        self._followers = followers

    def collect(self) -> Iterator[Metric]:
        yield GaugeMetricFamily(
            "cachet_cache_index_blocks",
            "(replica, block) pairs the index holds; a block on two replicas counts twice.",
            value=self._index.total_blocks(),
        )
        yield CounterMetricFamily(
            "cachet_cache_index_lookups", "MatchPrefix lookups answered.", value=self._index.figures.lookups
        )
        yield CounterMetricFamily(
            "cachet_cache_index_hit_blocks",
            "Sum over lookups of the longest prefix match, in blocks.",
            value=self._index.figures.hit_blocks,
        )
        yield GaugeMetricFamily(
            "cachet_cache_index_replicas_connected",
            "Engines whose KV event stream is up.",
            value=self._followers.connected_count(),
        )


def serve_metrics(index: PrefixIndex, followers: Followers, port: int, host: str = LOOPBACK) -> WSGIServer:
    """Serve /metrics on ``host:port`` (0: a free port) from a registry of its own, in a thread.

    The caller owns the returned server: ``shutdown()`` then ``server_close()`` it.
    """
    registry = CollectorRegistry()
    registry.register(IndexCollector(index, followers))
    server, _thread = start_http_server(port, addr=host, registry=registry)
    return server
