"""Prometheus figures of the prefix index, read from it at scrape time.

A collector (not module-level Counter/Gauge objects) so the index stays a plain
class that tests build many times, and so a scrape sees one consistent reading.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from cachet.cache.followers import Followers
from cachet.cache.prefix_index import TIERS, PrefixIndex


class IndexCollector(Collector):
    def __init__(self, index: PrefixIndex, followers: Followers) -> None:
        self._index = index
        self._followers = followers

    def collect(self) -> Iterator[Metric]:
        figures = self._index.figures
        blocks = GaugeMetricFamily(
            "cachet_cache_index_blocks",
            "(replica, block) pairs the index holds per tier; a block on two replicas counts twice.",
            labels=["tier"],
        )
        hits = CounterMetricFamily(
            "cachet_cache_index_hit_blocks",
            "Sum over lookups of the longest prefix match, in blocks, by the replica that holds it"
            " (its engine address; one series per replica ever followed) and the tier of each block.",
            labels=["replica", "tier"],
        )
        for tier in TIERS:
            blocks.add_metric([tier], self._index.total_blocks(tier))
        for address, counted in sorted(figures.by_replica.items()):
            for tier in TIERS:
                hits.add_metric([address, tier], counted.hit_blocks[tier])
        yield blocks
        yield hits
        yield CounterMetricFamily(
            "cachet_cache_index_lookups", "MatchPrefix lookups answered.", value=figures.lookups
        )
        yield GaugeMetricFamily(
            "cachet_cache_index_replicas_connected",
            "Engines whose KV event stream is up.",
            value=self._followers.connected_count(),
        )
