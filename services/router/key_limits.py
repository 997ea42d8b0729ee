"""Per-key limits: requests and tokens a minute, and a spend budget a calendar month.

Enforced in the router, not the bridge: the router is the public gRPC API too, it is
where a request's tokens are known, and its dispatcher is what runs queued jobs, which
count against their key when they run (a batch of a thousand is one cheap call to
queue; its jobs are admitted here one by one, as they start).

- Requests and tokens a minute: sliding 60-second windows (``KeyWindows``): in this
  router's memory with the SQLite store (one router), in the database with PostgreSQL
  (``postgres_key_windows``), so routers sharing it share each key's count. A call is
  admitted while the key's requests of the last minute are under its limit and its
  tokens under theirs. It counts one request when admitted and its tokens (prompt and
  completion) when its usage is recorded, as only then are they known; so a key can pass
  its token limit by the requests it has in flight, and is then refused until the window
  has room again.
- The monthly budget: the key's cost since the start of this UTC month, summed by the
  usage ledger (``QueryUsage`` by ``api_key_id``) and kept for ``budget_cache_seconds``.
  A key at or over its budget is refused until the month ends; requests in flight, and
  those admitted while the sum was cached, may pass it a little.

Over a per-minute limit: ``RateLimited`` (RESOURCE_EXHAUSTED, REST 429 with OpenAI's
``x-ratelimit-*`` headers and Retry-After); a queued job goes back to the queue. Over the
budget: ``QuotaExceeded`` (REST 429 ``insufficient_quota``); a queued job ends with that
error, as waiting for next month's budget would hold its batch open for weeks.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Protocol

import grpc

from cachet.common.v1 import common_pb2
from cachet.errors import CachetError, ResourceExhausted, Unavailable
from cachet.logs import get_logger
from cachet.router.api_keys import ApiKey
from cachet.router.caller import Caller
from cachet.usage.v1 import usage_pb2, usage_pb2_grpc

log = get_logger(__name__)

WINDOW_MS = 60_000
PICOUSD_PER_USD = 10**12


@dataclass
class RateLimited(ResourceExhausted):
    """A key's requests or tokens of the last minute are at its limit."""

    code_name: str = "rate_limit_exceeded"
    rate_limits: common_pb2.RateLimits = field(default_factory=common_pb2.RateLimits)

    def error_info(self) -> common_pb2.ErrorInfo:
        info = super().error_info()
        info.rate_limits.CopyFrom(self.rate_limits)
        return info


@dataclass
class QuotaExceeded(CachetError):
    """A key spent its monthly budget. Not a ResourceExhausted: retrying soon will not help,
    so a queued job ends with it instead of going back to the queue."""

    status: grpc.StatusCode = grpc.StatusCode.RESOURCE_EXHAUSTED
    error_type: str = "insufficient_quota"
    code_name: str = "insufficient_quota"


class SlidingWindow:
    """Amounts added over the last ``WINDOW_MS``; the oldest drop out as time passes."""

    def __init__(self) -> None:
        self._events: deque[tuple[int, int]] = deque()
        self._total = 0

    def used(self, now_ms: int) -> int:
        while self._events and self._events[0][0] <= now_ms - WINDOW_MS:
            self._total -= self._events.popleft()[1]
        return self._total

    def add(self, now_ms: int, amount: int) -> None:
        if amount > 0:
            self._events.append((now_ms, amount))
            self._total += amount

    def ms_until_under(self, limit: int, now_ms: int) -> int:
        """How long until what the window holds drops under ``limit`` (0: it is under now)."""
        total = self.used(now_ms)
        if total < limit:
            return 0
        for at_ms, amount in self._events:
            total -= amount
            if total < limit:
                return at_ms + WINDOW_MS - now_ms
        return WINDOW_MS  # only for a limit of 0, which no caller asks about


@dataclass
class KeyUse:
    """One key's requests and tokens of the last minute."""

    requests: SlidingWindow = field(default_factory=SlidingWindow)
    tokens: SlidingWindow = field(default_factory=SlidingWindow)

    def over(self, rpm: int, tpm: int, now_ms: int) -> tuple[bool, bool]:
        """Whether the requests, and the tokens, are at their limits (0: none)."""
        return bool(rpm) and self.requests.used(now_ms) >= rpm, bool(tpm) and self.tokens.used(now_ms) >= tpm

    def rate_limits(self, rpm: int, tpm: int, now_ms: int) -> common_pb2.RateLimits:
        """The limits and what is left of them, as the x-ratelimit-* headers say it."""
        limits = common_pb2.RateLimits(limit_requests=rpm, limit_tokens=tpm)
        if rpm:
            limits.remaining_requests = max(0, rpm - self.requests.used(now_ms))
            limits.reset_requests_ms = self.requests.ms_until_under(rpm, now_ms)
        if tpm:
            limits.remaining_tokens = max(0, tpm - self.tokens.used(now_ms))
            limits.reset_tokens_ms = self.tokens.ms_until_under(tpm, now_ms)
        return limits


class KeyWindows(Protocol):
    """Where keys' last minutes are counted: this router's memory, or a database routers share."""

    async def admit(self, key_id: str, now_ms: int, rpm: int, tpm: int) -> tuple[bool, KeyUse]:
        """Count one request if the key is under both limits, as one step for every caller;
        whether it was, and the key's use after."""
        ...

    async def add_tokens(self, key_id: str, now_ms: int, tokens: int) -> None: ...

    async def close(self) -> None: ...


class MemoryKeyWindows:
    """This router's own count: exact with one router (the SQLite store's case)."""

    def __init__(self) -> None:
        self._keys: dict[str, KeyUse] = {}

    async def admit(self, key_id: str, now_ms: int, rpm: int, tpm: int) -> tuple[bool, KeyUse]:
        use = self._keys.setdefault(key_id, KeyUse())
        admitted = not any(use.over(rpm, tpm, now_ms))
        if admitted:
            use.requests.add(now_ms, 1)
        return admitted, use

    async def add_tokens(self, key_id: str, now_ms: int, tokens: int) -> None:
        self._keys.setdefault(key_id, KeyUse()).tokens.add(now_ms, tokens)

    async def close(self) -> None:
        pass


def _now_ms() -> int:
    return int(time.time() * 1000)


def month_bounds_ms(now_ms: int) -> tuple[int, int]:
    """The UTC calendar month holding ``now_ms``: its first and the next month's first millisecond."""
    now = datetime.fromtimestamp(now_ms / 1000, UTC)
    start = now.replace(day=1, hour=0, minute=0, second=0, microsecond=0)
    end = (
        start.replace(year=start.year + 1, month=1)
        if start.month == 12
        else start.replace(month=start.month + 1)
    )
    return int(start.timestamp() * 1000), int(end.timestamp() * 1000)


class KeyLimiter:
    """Admits a managed key's calls under its limits; bootstrap keys and anonymous callers have none."""

    def __init__(
        self,
        usage: usage_pb2_grpc.UsageServiceAsyncStub,
        *,
        budget_cache_seconds: float,
        timeout_seconds: float,
        windows: KeyWindows | None = None,
        clock_ms: Callable[[], int] = _now_ms,
    ) -> None:
        self._usage = usage
        self._budget_cache_ms = int(budget_cache_seconds * 1000)
        self._timeout = timeout_seconds
        self.windows: KeyWindows = windows or MemoryKeyWindows()
        self._clock_ms = clock_ms
        # key id -> (when read, month start it was summed from, cost in pico-USD)
        self._spend: dict[str, tuple[int, int, int]] = {}
        self._counting: set[asyncio.Task[None]] = set()

    async def admit(self, caller: Caller) -> common_pb2.RateLimits | None:
        """Count one call of the caller's key, or raise RateLimited / QuotaExceeded; the key's
        per-minute limits and what is left of them after this call (None: it has none)."""
        key = caller.api_key
        if key is None or not key.limits.any:
            return None
        if key.limits.monthly_budget_picousd:
            await self._check_budget(key)
        rpm, tpm = key.limits.requests_per_minute, key.limits.tokens_per_minute
        if not rpm and not tpm:
            return None
        now = self._clock_ms()
        admitted, use = await self.windows.admit(key.key_id, now, rpm, tpm)
        limits = use.rate_limits(rpm, tpm, now)
        if admitted:
            return limits
        over_requests, over_tokens = use.over(rpm, tpm, now)
        wait_ms = max(
            limits.reset_requests_ms if over_requests else 0, limits.reset_tokens_ms if over_tokens else 0
        )
        what = "requests" if over_requests else "tokens"
        raise RateLimited(
            f"Rate limit reached for API key {key.key_id} on {what} per min: limit "
            f"{rpm if over_requests else tpm}. Please try again in {wait_ms / 1000:.3g}s.",
            retry_after_seconds=max(1, math.ceil(wait_ms / 1000)),
            error_type=what,
            rate_limits=limits,
        )

    def recorded(self, record: usage_pb2.UsageRecord) -> None:
        """A call's usage reached the ledger: its tokens count now, and its key's monthly spend is
        read again at the next admission rather than taken from the cache."""
        if not record.api_key_id:
            return
        self._spend.pop(record.api_key_id, None)
        tokens = record.prompt_tokens + record.completion_tokens
        if tokens > 0:
            task = asyncio.get_running_loop().create_task(self._add_tokens(record.api_key_id, tokens))
            self._counting.add(task)
            task.add_done_callback(self._counting.discard)

    async def close(self) -> None:
        if self._counting:
            await asyncio.wait(set(self._counting), timeout=5)
        await self.windows.close()

    async def _add_tokens(self, key_id: str, tokens: int) -> None:
        try:
            await self.windows.add_tokens(key_id, self._clock_ms(), tokens)
        except Exception as error:  # noqa: BLE001 - a lost count must not fail billing's callback
            log.warning("key tokens not counted", key_id=key_id, tokens=tokens, error=str(error))

    async def _check_budget(self, key: ApiKey) -> None:
        now = self._clock_ms()
        month_start, month_end = month_bounds_ms(now)
        spent = await self._spent(key.key_id, now, month_start)
        budget = key.limits.monthly_budget_picousd
        if spent >= budget:
            raise QuotaExceeded(
                f"API key {key.key_id} has spent its monthly budget (${budget / PICOUSD_PER_USD:.6f}"
                f"; spent ${spent / PICOUSD_PER_USD:.6f} this month). It renews at the start of next month (UTC).",
                retry_after_seconds=max(1, math.ceil((month_end - now) / 1000)),
            )

    async def _spent(self, key_id: str, now: int, month_start: int) -> int:
        cached = self._spend.get(key_id)
        if cached is not None and cached[1] == month_start and now - cached[0] < self._budget_cache_ms:
            return cached[2]
        try:
            answer = await self._usage.QueryUsage(
                usage_pb2.QueryUsageRequest(api_key_id=key_id, start_ms=month_start), timeout=self._timeout
            )
        except grpc.aio.AioRpcError as error:
            # Without the ledger a budget cannot be checked; refusing (retry later) is the safe side.
            raise Unavailable(
                f"usage service unreachable to check the key's budget: {error.code().name}"
            ) from None
        spent = answer.rows[0].cost_picousd if answer.rows else 0
        self._spend[key_id] = (now, month_start, spent)
        return spent
