"""`cachet report`: usage, cost, cached-token ratio and what the prefix cache saved, per UTC day,
model and session, read from the usage ledger.

The figures are the ledger's own sums (``Ledger.query``, the one the usage service answers
``QueryUsage`` with), so they cannot drift from what is billed: each entry's cost and saving
were computed when it was recorded, at the prices then in force (``cachet.usage.prices``:
by default $0.60 / 1M input, $0.10 / 1M cached input, $3.00 / 1M output tokens), in exact
pico-USD. "Saved" is what the cached tokens would have cost at the uncached input price,
minus what they cost; "uncached" is the cost had nothing been cached (cost + saved).

It opens the ledger the usage service uses (``CACHET_STORE_URL``'s PostgreSQL, else the SQLite
file under the data directory), and so sits above the services, as ``cachet replay`` does.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass, field
from decimal import ROUND_HALF_EVEN, Decimal
from pathlib import Path

from cachet.durable_postgres import is_postgres_url
from cachet.usage.ledger import DATABASE_NAME, Ledger, open_ledger
from cachet.usage.records import GroupField, UsageQuery, UsageTotals
from cachet.usage.settings import UsageSettings

PICOUSD_PER_USD = 10**12
MICRO_USD = Decimal("0.000001")
DAY_MS = 86_400_000


@dataclass(frozen=True)
class ReportScope:
    """Which entries the report sums: empty filters mean any; days are UTC and inclusive."""

    account_id: str = ""
    model: str = ""
    session_id: str = ""
    since: dt.date | None = None
    until: dt.date | None = None

    def query(self, *group_by: GroupField) -> UsageQuery:
        return UsageQuery(
            account_id=self.account_id,
            model=self.model,
            session_id=self.session_id,
            start_ms=_day_start_ms(self.since) if self.since else 0,
            end_ms=_day_start_ms(self.until) + DAY_MS if self.until else 0,
            group_by=group_by,
        )


def _day_start_ms(day: dt.date) -> int:
    return int(dt.datetime(day.year, day.month, day.day, tzinfo=dt.UTC).timestamp()) * 1000


@dataclass(frozen=True)
class UsageReport:
    scope: ReportScope
    source: str
    total: UsageTotals
    by_day: list[UsageTotals] = field(default_factory=list)
    by_model: list[UsageTotals] = field(default_factory=list)
    # The costliest sessions first, at most ``top_sessions`` of ``sessions`` in all.
    by_session: list[UsageTotals] = field(default_factory=list)
    sessions: int = 0


async def build_report(ledger: Ledger, scope: ReportScope, top_sessions: int = 20) -> UsageReport:
    """The ledger's sums over ``scope``: in all, per day, per model, per session."""
    (total,) = await ledger.query(scope.query())
    sessions = await ledger.query(scope.query(GroupField.SESSION))
    costliest = sorted(sessions, key=lambda row: (-row.cost_picousd, row.session_id))
    return UsageReport(
        scope=scope,
        source=ledger.location,
        total=total,
        by_day=await ledger.query(scope.query(GroupField.DAY)),
        by_model=await ledger.query(scope.query(GroupField.MODEL)),
        by_session=costliest[:top_sessions],
        sessions=len(sessions),
    )


class LedgerNotFound(Exception):
    """No ledger file where the usage service would keep one."""


async def open_report_ledger(settings: UsageSettings) -> Ledger:
    """The ledger the usage service with these settings writes; a SQLite file must exist already
    (opening one would create an empty ledger, and a report of nothing hides a wrong path)."""
    if not (settings.store_url and is_postgres_url(settings.store_url)):
        path = settings.database or settings.data_dir / DATABASE_NAME
        if not Path(path).is_file():
            raise LedgerNotFound(
                f"no usage ledger at {path} (set CACHET_DATA_DIR, --ledger, or CACHET_STORE_URL)"
            )
    return await open_ledger(settings)


def usd(picousd: int) -> Decimal:
    """Pico-USD as dollars, rounded to the micro-dollar (half to even)."""
    return (Decimal(picousd) / PICOUSD_PER_USD).quantize(MICRO_USD, rounding=ROUND_HALF_EVEN)


def cached_ratio(row: UsageTotals) -> float:
    return row.cached_tokens / row.prompt_tokens if row.prompt_tokens else 0.0


def row_json(row: UsageTotals) -> dict:
    """One row's figures: exact integers (tokens, pico-USD) and dollars to the micro-dollar."""
    uncached = row.cost_picousd + row.cache_savings_picousd
    return {
        "requests": row.requests,
        "prompt_tokens": row.prompt_tokens,
        "cached_tokens": row.cached_tokens,
        "completion_tokens": row.completion_tokens,
        "cached_ratio": round(cached_ratio(row), 6),
        "cost_picousd": row.cost_picousd,
        "saved_picousd": row.cache_savings_picousd,
        "uncached_cost_picousd": uncached,
        "cost_usd": float(usd(row.cost_picousd)),
        "saved_usd": float(usd(row.cache_savings_picousd)),
        "uncached_cost_usd": float(usd(uncached)),
    }


def report_json(report: UsageReport) -> dict:
    scope = report.scope
    return {
        "source": report.source,
        "scope": {
            "account": scope.account_id or None,
            "model": scope.model or None,
            "session": scope.session_id or None,
            "since": scope.since.isoformat() if scope.since else None,
            "until": scope.until.isoformat() if scope.until else None,
        },
        "total": row_json(report.total),
        "by_day": [{"day": row.day, **row_json(row)} for row in report.by_day],
        "by_model": [{"model": row.model, **row_json(row)} for row in report.by_model],
        "by_session": [{"session": row.session_id, **row_json(row)} for row in report.by_session],
        "sessions": report.sessions,
    }


_COLUMNS = ("requests", "prompt tok", "cached tok", "cached", "output tok", "cost $", "saved $", "uncached $")


def _cells(row: UsageTotals) -> list[str]:
    return [
        f"{row.requests:,}",
        f"{row.prompt_tokens:,}",
        f"{row.cached_tokens:,}",
        f"{cached_ratio(row):.1%}",
        f"{row.completion_tokens:,}",
        str(usd(row.cost_picousd)),
        str(usd(row.cache_savings_picousd)),
        str(usd(row.cost_picousd + row.cache_savings_picousd)),
    ]


def format_report(report: UsageReport) -> str:
    """Tables for people: the total, then per day, model and session."""
    sections: list[tuple[str, list[tuple[str, UsageTotals]]]] = [
        ("", [("total", report.total)]),
        ("day (UTC)", [(row.day, row) for row in report.by_day]),
        ("model", [(row.model, row) for row in report.by_model]),
        (
            f"session ({len(report.by_session)} costliest of {report.sessions})",
            [(row.session_id or "(none)", row) for row in report.by_session],
        ),
    ]
    labels = [label for _, rows in sections for label, _ in rows] + [title for title, _ in sections]
    cells = [_cells(row) for _, rows in sections for _, row in rows]
    label_width = max(map(len, labels))
    widths = [max(len(name), *(len(line[i]) for line in cells)) for i, name in enumerate(_COLUMNS)]

    def line(label: str, values: list[str] | tuple[str, ...]) -> str:
        return "  ".join(
            [label.ljust(label_width), *(v.rjust(w) for v, w in zip(values, widths, strict=True))]
        )

    out = [f"Usage from {report.source}{_describe(report.scope)}"]
    for title, rows in sections:
        out.append("")
        out.append(line(title, _COLUMNS))
        out += [line(label, _cells(row)) for label, row in rows]
    return "\n".join(out)


def _describe(scope: ReportScope) -> str:
    parts = [
        f"{name} {value}"
        for name, value in (
            ("account", scope.account_id),
            ("model", scope.model),
            ("session", scope.session_id),
        )
        if value
    ]
    if scope.since or scope.until:
        parts.append(f"days {scope.since or '...'} to {scope.until or '...'}")
    return f" ({', '.join(parts)})" if parts else " (all accounts, all days)"
