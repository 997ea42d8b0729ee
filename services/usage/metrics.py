"""Prometheus counters for the usage service, wrapping the ledger's outcomes.

They live in the process-wide default registry, so whichever exporter the
process runs (a scrape endpoint, a push gateway) sees them. Labels stay
bounded: the model set is small; accounts and sessions are never labels.
"""

from __future__ import annotations

from prometheus_client import Counter

from cachet.usage.prices import ModelPrice
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

# Dollars as floats, for rates and dashboards; the ledger keeps the exact pico-USD (cachet report).
COST_USD = Counter("cachet_usage_cost_usd", "Cost of the recorded requests, in US dollars.", ["model"])
CACHE_SAVINGS_USD = Counter(
    "cachet_usage_cache_savings_usd",
    "What cached prompt tokens saved against the uncached input price, in US dollars.",
    ["model"],
)
_PICOUSD_PER_USD = 1e12


def observe_record(entry: UsageEntry, outcome: RecordOutcome, price: ModelPrice) -> None:
    """Count one RecordUsage call; a duplicate adds no tokens or cost, exactly as in the ledger.
    ``price`` is the one the entry was recorded at (a new entry's: the one in force)."""
    if outcome.duplicate:
        DUPLICATE_RECORDS.labels(entry.model).inc()
        return
    RECORDS.labels(entry.model).inc()
    TOKENS.labels(entry.model, "prompt").inc(entry.prompt_tokens)
    TOKENS.labels(entry.model, "cached").inc(entry.cached_tokens)
    TOKENS.labels(entry.model, "completion").inc(entry.completion_tokens)
    COST_USD.labels(entry.model).inc(outcome.cost_picousd / _PICOUSD_PER_USD)
    CACHE_SAVINGS_USD.labels(entry.model).inc(
        price.cache_savings_picousd(entry.cached_tokens) / _PICOUSD_PER_USD
    )
