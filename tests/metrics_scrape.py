"""Reading a service's Prometheus /metrics in tests: every sample, keyed for before/after deltas;
and whether its names follow Prometheus's conventions."""

from __future__ import annotations

import re
import urllib.request
from collections.abc import Callable

from prometheus_client.parser import text_string_to_metric_families

from cachet.tls import TlsSettings, http_client_context

Figures = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(port: int, prefix: str = "cachet_", tls: TlsSettings | None = None) -> Figures:
    """(sample name, sorted labels) -> value, for every family whose name starts with ``prefix``;
    over HTTPS verified (and with the client certificate) of ``tls``, when given."""
    text = exposition(port, tls)
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


_METRIC_NAME = re.compile(r"^[a-z_][a-z0-9_]*$")
_LABEL_NAME = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")
# Base units only (https://prometheus.io/docs/practices/naming/): seconds, bytes.
_NOT_BASE_UNITS = {"ms", "milliseconds", "us", "microseconds", "ns", "minutes", "hours", "kb", "mb", "gb"}
_RESERVED_SUFFIXES = ("_total", "_count", "_sum", "_bucket", "_created")


def naming_problems(text: str) -> list[str]:
    """What in an exposition breaks Prometheus's naming conventions: snake_case names, base units,
    ``_total`` on counters and only there, a help text, valid label names, and time in
    histograms counted in ``_seconds``."""
    problems = []
    families = list(text_string_to_metric_families(text))
    names = {family.name for family in families}
    for family in families:
        name = family.name
        if name.endswith("_created") and name.removesuffix("_created") in names:
            continue  # the client's creation time of a counter or histogram, read as a gauge
        if not _METRIC_NAME.match(name):
            problems.append(f"{name}: not snake_case")
        if not family.documentation:
            problems.append(f"{name}: no HELP")
        if _NOT_BASE_UNITS & set(name.split("_")):
            problems.append(f"{name}: not in base units")
        if family.type == "counter":
            # (A labelled counter that has counted nothing yet has no samples at all.)
            if family.samples and not any(sample.name == f"{name}_total" for sample in family.samples):
                problems.append(f"{name}: a counter not exposed as {name}_total")
        elif name.endswith(_RESERVED_SUFFIXES):
            problems.append(f"{name}: a {family.type} named like a counter or histogram part")
        timed = re.search(r"(time|duration|latency|lag|age|wait)", name)
        if family.type == "histogram" and timed and not name.endswith("_seconds"):
            problems.append(f"{name}: a time histogram not in _seconds")
        labels = {label for sample in family.samples for label in sample.labels}
        problems += [f"{name}: bad label {label!r}" for label in labels if not _LABEL_NAME.match(label)]
        problems += [f"{name}: reserved label {label!r}" for label in labels if label.startswith("__")]
    return problems


def exposition(port: int, tls: TlsSettings | None = None) -> str:
    context = http_client_context(tls) if tls is not None else None
    url = f"{'https' if context else 'http'}://127.0.0.1:{port}/metrics"
    with urllib.request.urlopen(url, timeout=10, context=context) as response:
        return response.read().decode()


_SAMPLE_SUFFIXES = {
    "counter": ("_total",),
    "histogram": ("_bucket", "_sum", "_count"),
    "summary": ("_sum", "_count"),
}


def exported_names(text: str) -> set[str]:
    """Every sample name an exposition declares, whether or not a labelled family has samples yet
    (``x_total`` for a counter, ``x_bucket``/``x_sum``/``x_count`` for a histogram)."""
    names = set()
    for family in text_string_to_metric_families(text):
        suffixes = _SAMPLE_SUFFIXES.get(family.type, ("",))
        names |= {family.name + suffix for suffix in suffixes}
        names |= {sample.name for sample in family.samples}
    return names
