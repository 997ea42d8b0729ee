"""A ``UsageQuery`` as SQL, for either ledger: the same sums, groups and filters on SQLite and PostgreSQL.

The two dialects differ only in how a parameter is written (``?`` against ``$1``) and
in how a Unix time in milliseconds becomes a UTC day, so those two are arguments.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from cachet.usage.records import GroupField, UsageQuery, UsageTotals

# The only SQL spliced into a query besides the dialect's day expression: fixed
# expressions chosen by enum, never caller text.
_GROUP_COLUMNS: dict[GroupField, str] = {
    GroupField.ACCOUNT: "account_id",
    GroupField.MODEL: "model",
    GroupField.SESSION: "session_id",
}
_TOTALS_KEY_FIELD: dict[GroupField, str] = {
    GroupField.ACCOUNT: "account_id",
    GroupField.MODEL: "model",
    GroupField.DAY: "day",
    GroupField.SESSION: "session_id",
}
_SUMS = """COUNT(*), COALESCE(SUM(prompt_tokens), 0), COALESCE(SUM(cached_tokens), 0),
    COALESCE(SUM(completion_tokens), 0), COALESCE(SUM(cost_picousd), 0), COALESCE(SUM(cache_savings_picousd), 0)"""
_SUM_FIELDS = (
    "requests",
    "prompt_tokens",
    "cached_tokens",
    "completion_tokens",
    "cost_picousd",
    "cache_savings_picousd",
)


def query_sql(
    query: UsageQuery, *, day_expression: str, placeholder: Callable[[int], str]
) -> tuple[str, list[Any]]:
    """The statement and its parameters; ``placeholder(n)`` writes the n-th parameter (from 1)."""
    where, params = _where(query, placeholder)
    keys = [day_expression if field is GroupField.DAY else _GROUP_COLUMNS[field] for field in query.group_by]
    if not keys:
        # No grouping: one total row, present (all zeros) even when nothing matched.
        return f"SELECT {_SUMS} FROM usage_records{where}", params
    key_list = ", ".join(keys)
    return (
        f"SELECT {key_list}, {_SUMS} FROM usage_records{where} GROUP BY {key_list} ORDER BY {key_list}",
        params,
    )


def totals(group_by: tuple[GroupField, ...], row: tuple[Any, ...]) -> UsageTotals:
    """One result row as totals; sums come back as ``int`` whatever numeric type the driver chose."""
    keys = {_TOTALS_KEY_FIELD[field]: value for field, value in zip(group_by, row, strict=False)}
    sums: dict[str, Any] = {
        name: int(value) for name, value in zip(_SUM_FIELDS, row[len(group_by) :], strict=True)
    }
    return UsageTotals(**keys, **sums)


def _where(query: UsageQuery, placeholder: Callable[[int], str]) -> tuple[str, list[Any]]:
    clauses: list[str] = []
    params: list[Any] = []

    def compare(expression: str, value: Any) -> None:
        params.append(value)
        clauses.append(expression.format(placeholder(len(params))))

    for column, value in (
        ("account_id", query.account_id),
        ("model", query.model),
        ("session_id", query.session_id),
        ("api_key_id", query.api_key_id),
    ):
        if value:
            compare(f"{column} = {{}}", value)
    if query.start_ms:
        compare("finished_at_ms >= {}", query.start_ms)
    if query.end_ms:
        compare("finished_at_ms < {}", query.end_ms)
    return (" WHERE " + " AND ".join(clauses)) if clauses else "", params
