"""``cachet keys create|list|revoke``: managed API keys, written straight into the router's store.

The command opens the store the router opens (``CACHET_STORE_URL``, else the queue's
SQLite file under ``CACHET_DATA_DIR``), so whoever can reach the store administers
keys, and no network API can mint one. Routers see a new key at its first use and a
revoked one within ``CACHET_ROUTER_API_KEY_CACHE_SECONDS``.
"""

from __future__ import annotations

import asyncio
import time
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any

from cachet.logs import configure_logging
from cachet.router.api_keys import ApiKey, KeyLimits, new_api_key
from cachet.router.key_limits import PICOUSD_PER_USD
from cachet.router.queue_store import QueueStore, open_queue_store
from cachet.router.settings import RouterSettings

_DAY_MS = 86_400_000


def create(
    account: str,
    name: str,
    expires_in_days: float | None,
    requests_per_minute: int,
    tokens_per_minute: int,
    monthly_budget_usd: Decimal | None,
) -> dict[str, Any]:
    """Make a key; the answer holds the key itself, which is shown this once."""
    now = int(time.time() * 1000)
    limits = KeyLimits(
        requests_per_minute=requests_per_minute,
        tokens_per_minute=tokens_per_minute,
        monthly_budget_picousd=int((monthly_budget_usd or Decimal(0)) * PICOUSD_PER_USD),
    )
    expires_at_ms = now + int(expires_in_days * _DAY_MS) if expires_in_days else 0
    key, record = new_api_key(account, name, now, expires_at_ms=expires_at_ms, limits=limits)

    async def store_it(store: QueueStore) -> None:
        await store.create_api_key(record)

    _with_store(store_it)
    return {"key": key} | describe(record, now)


def list_keys(account: str) -> list[dict[str, Any]]:
    async def read(store: QueueStore) -> list[ApiKey]:
        return await store.api_keys(account)

    now = int(time.time() * 1000)
    return [describe(record, now) for record in _with_store(read)]


def revoke(key_id: str) -> dict[str, Any] | None:
    async def revoke_it(store: QueueStore) -> ApiKey | None:
        return await store.revoke_api_key(key_id)

    record = _with_store(revoke_it)
    return None if record is None else describe(record, int(time.time() * 1000))


def describe(record: ApiKey, now_ms: int) -> dict[str, Any]:
    """A key's record as the command prints it: never its hash, times in UTC ISO 8601."""
    return {
        "key_id": record.key_id,
        "account": record.account_id,
        "name": record.name,
        "state": record.state_at(now_ms),
        "created_at": _iso(record.created_at_ms),
        "last_used_at": _iso(record.last_used_at_ms),
        "expires_at": _iso(record.expires_at_ms),
        "revoked_at": _iso(record.revoked_at_ms),
        "requests_per_minute": record.limits.requests_per_minute or None,
        "tokens_per_minute": record.limits.tokens_per_minute or None,
        "monthly_budget_usd": (
            str(Decimal(record.limits.monthly_budget_picousd) / PICOUSD_PER_USD)
            if record.limits.monthly_budget_picousd
            else None
        ),
    }


def _iso(ms: int) -> str | None:
    return datetime.fromtimestamp(ms / 1000, UTC).isoformat(timespec="seconds") if ms else None


def _with_store(work):  # noqa: ANN001, ANN202 - a coroutine function of the store, and its result
    # The store's own log lines go to stderr, quietly: stdout is the command's answer.
    configure_logging("keys", "warning")

    async def run() -> Any:
        store = await open_queue_store(RouterSettings())
        try:
            return await work(store)
        finally:
            await store.close()

    return asyncio.run(run())
