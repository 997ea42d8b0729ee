"""Who is calling: the account billed, the managed key whose limits apply, the session kept on one replica.

The account comes from ``authorization: Bearer <key>`` or ``x-api-key: <key>`` metadata, as
the bridge reads the same headers over REST: a key of
``CACHET_API_KEYS`` (the bootstrap keys: configured, no limits) or a managed key
made by ``cachet keys create`` and kept, hashed, in the queue store (api_keys.py).
With no bootstrap key configured (development on loopback) everyone is
``anonymous``, managed keys or not; that open mode listens on loopback only
(``refuse_open_mode_beyond_loopback``). The session comes from ``x-session-affinity``
metadata, which wins over the request's own ``session_id`` field.

Managed keys are read through a short cache (``cache_seconds``): a key revoked in
the store stops working here within that time, on every router sharing the store.
"""

from __future__ import annotations

import asyncio
import hmac
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Protocol

from cachet.errors import Unauthenticated
from cachet.logs import get_logger
from cachet.router.api_keys import ApiKey, key_id_of
from cachet.tls import is_loopback

log = get_logger(__name__)

ANONYMOUS_ACCOUNT = "anonymous"
SESSION_METADATA_KEY = "x-session-affinity"
API_KEY_METADATA_KEY = "x-api-key"
_BEARER = "bearer "
# A key's last use is written at most this often per router: a write per request would
# cost every call a store round trip for a time nobody needs to the millisecond.
_TOUCH_EVERY_MS = 60_000


@dataclass(frozen=True)
class Caller:
    account_id: str
    session_id: str
    # The managed key the call came with (its limits apply); None for a bootstrap key.
    api_key: ApiKey | None = None

    @property
    def api_key_id(self) -> str:
        return self.api_key.key_id if self.api_key is not None else ""


class KeyRecords(Protocol):
    """What the directory reads and writes of the store's managed keys (QueueStore has it)."""

    async def api_key(self, key_id: str) -> ApiKey | None: ...

    async def touch_api_key(self, key_id: str, at_ms: int) -> None: ...

    async def batch_api_key(self, batch_id: str) -> str: ...


def refuse_open_mode_beyond_loopback(api_keys: Mapping[str, str], host: str) -> None:
    """The router is a public API too: without a bootstrap key everyone is ``anonymous``, which
    only a developer's own machine may offer (the bridge refuses the same)."""
    if not api_keys and not is_loopback(host):
        raise ValueError(
            f"no API keys configured (CACHET_API_KEYS): open development mode may only listen on "
            f"loopback, not {host!r}"
        )


def _key_from(headers: Mapping[str, str]) -> str:
    authorization = headers.get("authorization", "")
    if authorization.lower().startswith(_BEARER):
        return authorization[len(_BEARER) :].strip()
    if key := headers.get(API_KEY_METADATA_KEY, "").strip():
        return key
    raise Unauthenticated(
        f"missing 'authorization: Bearer <key>' or '{API_KEY_METADATA_KEY}: <key>' metadata"
    )


def _now_ms() -> int:
    return int(time.time() * 1000)


class AccountDirectory:
    """Maps API keys to callers: bootstrap keys from the settings, managed keys from the store."""

    def __init__(
        self,
        api_keys: Mapping[str, str],
        store: KeyRecords | None = None,
        *,
        cache_seconds: float = 5.0,
        clock_ms: Callable[[], int] = _now_ms,
    ) -> None:
        self._accounts = dict(api_keys)
        self._store = store
        self._cache_ms = int(cache_seconds * 1000)
        self._clock_ms = clock_ms
        self._records: dict[str, tuple[int, ApiKey | None]] = {}
        self._touched: dict[str, int] = {}
        self._touching: set[asyncio.Task[None]] = set()

    async def caller(
        self, metadata: Iterable[tuple[str, str | bytes]] | None, request_session_id: str
    ) -> Caller:
        headers = {key.lower(): value for key, value in metadata or () if isinstance(value, str)}
        session = headers.get(SESSION_METADATA_KEY, "").strip() or request_session_id
        if not self._accounts:
            return Caller(ANONYMOUS_ACCOUNT, session)
        key = _key_from(headers)
        account = self._bootstrap_account(key)
        if account is not None:
            return Caller(account, session)
        record = await self._managed(key)
        if record is None:
            raise Unauthenticated("unknown API key")
        return Caller(record.account_id, session, record)

    async def batch_caller(self, account_id: str, batch_id: str, session_id: str) -> Caller:
        """The caller a queued job runs as: its batch's account, and the managed key it was queued
        with, whose limits it counts against when it runs. A key revoked or expired since ends
        the job (Unauthenticated): a leaked key's revoke must stop the work it queued too."""
        key_id = await self._store.batch_api_key(batch_id) if self._store is not None else ""
        record = await self._record(key_id) if key_id else None
        if record is not None and not record.usable_at(self._clock_ms()):
            raise Unauthenticated(
                f"the API key {key_id} that queued this batch is {record.state_at(self._clock_ms())}"
            )
        return Caller(account_id, session_id, record)

    def _bootstrap_account(self, key: str) -> str | None:
        # Every configured key is compared, in constant time, so timing tells nothing of a prefix.
        found = None
        for known, account in self._accounts.items():
            if hmac.compare_digest(known.encode(), key.encode()):
                found = account
        return found

    async def _managed(self, key: str) -> ApiKey | None:
        key_id = key_id_of(key)
        if key_id is None or self._store is None:
            return None
        record = await self._record(key_id)
        now = self._clock_ms()
        if record is None or not record.matches(key) or not record.usable_at(now):
            return None
        self._touch(record.key_id, now)
        return record

    async def _record(self, key_id: str) -> ApiKey | None:
        now = self._clock_ms()
        cached = self._records.get(key_id)
        if cached is not None and now - cached[0] < self._cache_ms:
            return cached[1]
        assert self._store is not None
        record = await self._store.api_key(key_id)
        if len(self._records) > 100_000:  # unknown ids are cached too: bound what a key-guesser can grow
            self._records.clear()
        self._records[key_id] = (now, record)
        return record

    def _touch(self, key_id: str, now: int) -> None:
        if now - self._touched.get(key_id, -_TOUCH_EVERY_MS) < _TOUCH_EVERY_MS:
            return
        self._touched[key_id] = now
        task = asyncio.get_running_loop().create_task(self._write_touch(key_id, now))
        self._touching.add(task)
        task.add_done_callback(self._touching.discard)

    async def _write_touch(self, key_id: str, now: int) -> None:
        assert self._store is not None
        try:
            await self._store.touch_api_key(key_id, now)
        except Exception as error:  # noqa: BLE001 - a missed last-use time must not fail anything
            log.warning("api key last use not written", key_id=key_id, error=str(error))
