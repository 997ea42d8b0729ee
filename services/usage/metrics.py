"""Prometheus counters for the usage service, wrapping the ledger's outcomes.

They live in the process-wide default registry, so whichever exporter the
process runs (a scrape endpoint, a push gateway) sees them. Labels stay
bounded: the model set is small; accounts and sessions are never labels.
"""

from __future__ import annotations

from prometheus_client import Counter

from cachet.usage.records import RecordOutcome, UsageEntry

RECORDS = Counter("cachet_usage_records", "Usage records appended to the ledger.", ["model"])
DUPLICATE_RECORDS = Counter(
    "cachet_usage_duplicate_records",
    "Records whose request id was already in the ledger (retries).",
    ["model"],
)
TOKENS = Counter(
    "cachet_usage_tokens", "Tokens recorded, by kind (prompt includes cached).", ["model", "kind"]
)


def observe_record(entry: UsageEntry, outcome: RecordOutcome) -> None:
    """Count one RecordUsage call; a duplicate adds no tokens, exactly as in the ledger."""
    if outcome.duplicate:
        DUPLICATE_RECORDS.labels(entry.model).inc()
        return
    RECORDS.labels(entry.model).inc()
    TOKENS.labels(entry.model, "prompt").inc(entry.prompt_tokens)
    TOKENS.labels(entry.model, "cached").inc(entry.cached_tokens)
    TOKENS.labels(entry.model, "completion").inc(entry.completion_tokens)
