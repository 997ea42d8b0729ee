"""The ledger's domain types: one request's usage, a query over many, their totals.

Validation lives in the constructors, so a bad value is refused with the
offending field's name wherever the object is built (servicer, tests, a future
batch importer) and the ledger only ever sees valid entries.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Iterable
from dataclasses import dataclass

from cachet.errors import InvalidArgument
from cachet.usage.prices import ModelPrice

# Request, account and session ids are keys and labels, not payloads: bound them
# so one bad client cannot bloat the ledger's primary-key index.
MAX_ID_CHARS = 512


def _require_id(name: str, value: str, required: bool = True) -> None:
    if required and not value:
        raise InvalidArgument(f"{name} must not be empty", param=name)
    if len(value) > MAX_ID_CHARS:
        raise InvalidArgument(f"{name} is longer than {MAX_ID_CHARS} characters", param=name)


@dataclass(frozen=True)
class UsageEntry:
    """One request's usage as the ledger stores it.

    ``prompt_tokens`` includes ``cached_tokens``; ``finished_at_ms`` is Unix
    milliseconds and decides which UTC day the entry is counted on.
    """

    request_id: str
    account_id: str
    model: str
    session_id: str
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    finished_at_ms: int
    replica_address: str = ""
    priority: str = ""
    # The managed API key the request came with (a key's monthly budget sums its entries).
    api_key_id: str = ""

    def __post_init__(self) -> None:
        _require_id("request_id", self.request_id)
        _require_id("api_key_id", self.api_key_id, required=False)
        _require_id("account_id", self.account_id)
        _require_id("model", self.model)
        _require_id("session_id", self.session_id, required=False)
        for name in ("prompt_tokens", "cached_tokens", "completion_tokens"):
            if getattr(self, name) < 0:
                raise InvalidArgument(f"{name} must not be negative", param=name)
        if self.cached_tokens > self.prompt_tokens:
            raise InvalidArgument(
                f"cached_tokens ({self.cached_tokens}) must not exceed prompt_tokens ({self.prompt_tokens})",
                param="cached_tokens",
            )
        if self.finished_at_ms <= 0:
            raise InvalidArgument(
                "finished_at_ms must be a positive Unix time in milliseconds", param="finished_at_ms"
            )


@dataclass(frozen=True)
class RecordOutcome:
    """What recording did: ``duplicate`` entries changed nothing and report the stored cost."""

    duplicate: bool
    cost_picousd: int


class GroupField(enum.StrEnum):
    """The fields a query can group by; the values are the names on the wire."""

    ACCOUNT = "account"
    MODEL = "model"
    DAY = "day"
    SESSION = "session"


def parse_group_by(names: Iterable[str]) -> tuple[GroupField, ...]:
    """Wire names to fields, in the caller's order, repeats dropped; unknown names are refused."""
    fields: list[GroupField] = []
    for name in names:
        try:
            field = GroupField(name)
        except ValueError:
            allowed = ", ".join(f.value for f in GroupField)
            raise InvalidArgument(
                f"group_by has unknown field {name!r}; allowed: {allowed}", param="group_by"
            ) from None
        if field not in fields:
            fields.append(field)
    return tuple(fields)


@dataclass(frozen=True)
class UsageQuery:
    """Which entries to sum and how to group them; empty filters and 0 bounds mean "any".

    ``start_ms`` is inclusive and ``end_ms`` exclusive. An ``end_ms`` of 0 is the
    wire's "now"; it is read as "no upper bound", which is the same thing for
    every entry not stamped in the future, and never hides a clock-skewed one.
    """

    account_id: str = ""
    model: str = ""
    session_id: str = ""
    start_ms: int = 0
    end_ms: int = 0
    group_by: tuple[GroupField, ...] = ()
    api_key_id: str = ""

    def __post_init__(self) -> None:
        if self.start_ms < 0:
            raise InvalidArgument("start_ms must not be negative", param="start_ms")
        if self.end_ms < 0:
            raise InvalidArgument("end_ms must not be negative", param="end_ms")
        if self.end_ms and self.end_ms <= self.start_ms:
            raise InvalidArgument("end_ms must be after start_ms (or 0 for no bound)", param="end_ms")


@dataclass(frozen=True)
class UsageTotals:
    """One group's sums; key fields not grouped by stay empty."""

    account_id: str = ""
    model: str = ""
    day: str = ""
    session_id: str = ""
    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    cost_picousd: int = 0
    cache_savings_picousd: int = 0


# Where ledger_row puts the cost (picodollars).
LEDGER_COST_COLUMN = 13


def ledger_row(entry: UsageEntry, price: ModelPrice) -> tuple:
    """One ledger row's values in the column order both stores insert: the entry, the prices
    it was billed at, its cost and savings, when it was recorded, and its API key (a column
    added later, so last)."""
    return (
        entry.request_id,
        entry.account_id,
        entry.model,
        entry.session_id,
        entry.prompt_tokens,
        entry.cached_tokens,
        entry.completion_tokens,
        entry.finished_at_ms,
        entry.replica_address,
        entry.priority,
        price.input_microusd_per_mtok,
        price.cached_input_microusd_per_mtok,
        price.output_microusd_per_mtok,
        price.cost_picousd(entry.prompt_tokens, entry.cached_tokens, entry.completion_tokens),
        price.cache_savings_picousd(entry.cached_tokens),
        int(time.time() * 1000),
        entry.api_key_id,
    )
