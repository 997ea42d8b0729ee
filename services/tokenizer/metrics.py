"""Prometheus figures of the tokenizer's own, read at scrape time: its prepared-image cache.

A collector (not module-level Counter objects) so the cache stays a plain class that tests build
many times, and so a scrape sees one consistent reading. The gRPC calls' figures come from
``cachet.grpc_metrics`` like every service's.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from cachet.tokenizer.image_cache import PreparedImageCache


class ImageCacheCollector(Collector):
    def __init__(self, cache: PreparedImageCache) -> None:
        self._cache = cache

    def collect(self) -> Iterator[Metric]:
        figures = self._cache.figures
        yield CounterMetricFamily(
            "cachet_tokenizer_image_cache_hits",
            "Image parts whose bytes were seen before: not decoded or resized again.",
            value=figures.hits,
        )
        yield CounterMetricFamily(
            "cachet_tokenizer_image_cache_misses",
            "Image parts decoded and resized (bytes not in the cache).",
            value=figures.misses,
        )
        yield CounterMetricFamily(
            "cachet_tokenizer_image_cache_evictions",
            "Prepared images dropped, least recently used first, to stay within the capacity.",
            value=figures.evictions,
        )
        yield GaugeMetricFamily(
            "cachet_tokenizer_image_cache_bytes",
            "Bytes of prepared pixels the cache holds.",
            value=figures.size_bytes,
        )
        yield GaugeMetricFamily(
            "cachet_tokenizer_image_cache_capacity_bytes",
            "The most bytes of prepared pixels the cache holds (CACHET_TOKENIZER_IMAGE_CACHE_BYTES).",
            value=figures.capacity_bytes,
        )
