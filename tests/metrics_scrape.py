"""Reading a service's Prometheus /metrics in tests: every sample, keyed for before/after deltas."""

from __future__ import annotations

import urllib.request
from collections.abc import Callable

from prometheus_client.parser import text_string_to_metric_families

Figures = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(port: int, prefix: str = "cachet_") -> Figures:
    """(sample name, sorted labels) -> value, for every family whose name starts with ``prefix``."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        if family.name.startswith(prefix)
        for sample in family.samples
    }


def growth(before: Figures, after: Figures) -> Callable[..., float]:
    """``grew(name, **labels)``: how much that sample rose between the scrapes (absent: 0)."""

    def grew(name: str, **labels: str) -> float:
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0.0) - before.get(key, 0.0)

    return grew
