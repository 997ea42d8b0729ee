"""Per-key limits: requests and tokens a minute, and a spend budget a calendar month.

Enforced in the router, not the bridge: the router is the public gRPC API too, it is
where a request's tokens are known, and its dispatcher is what runs queued jobs, which
count against their key when they run (a batch of a thousand is one cheap call to
queue; its jobs are admitted here one by one, as they start).

- Requests and tokens a minute: sliding 60-second windows in this router's memory. A
  call is admitted while the key's requests of the last minute are under its limit and
  its tokens under theirs. It counts one request when admitted and its tokens (prompt
  and completion) when its usage is recorded, as only then are they known; so a key can
  pass its token limit by the requests it has in flight, and is then refused until the
  window has room again. Several routers on one store count apart: each allows the key
  its full limit.
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

import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime

import grpc

from cachet.bridge.v1 import bridge_pb2
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
    rate_limits: bridge_pb2.RateLimits = field(default_factory=bridge_pb2.RateLimits)

    def error_info(self) -> bridge_pb2.ErrorInfo:
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
class _KeyWindows:
    requests: SlidingWindow = field(default_factory=SlidingWindow)
    tokens: SlidingWindow = field(default_factory=SlidingWindow)


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
        usage: usage_pb2_grpc.UsageServiceStub,
        *,
        budget_cache_seconds: float,
        timeout_seconds: float,
        clock_ms: Callable[[], int] = _now_ms,
    ) -> None:
        self._usage = usage
        self._budget_cache_ms = int(budget_cache_seconds * 1000)
        self._timeout = timeout_seconds
        self._clock_ms = clock_ms
        self._windows: dict[str, _KeyWindows] = {}
        # key id -> (when read, month start it was summed from, cost in pico-USD)
        self._spend: dict[str, tuple[int, int, int]] = {}

    async def admit(self, caller: Caller) -> None:
        """Count one call of the caller's key, or raise RateLimited / QuotaExceeded."""
        key = caller.api_key
        if key is None or not key.limits.any:
            return
        if key.limits.monthly_budget_picousd:
            await self._check_budget(key)
        # No await from here on: the check and the count are one step for concurrent calls.
        now = self._clock_ms()
        windows = self._windows.setdefault(key.key_id, _KeyWindows())
        limits = self.rate_limits(key, now)
        rpm, tpm = key.limits.requests_per_minute, key.limits.tokens_per_minute
        over_requests = bool(rpm) and windows.requests.used(now) >= rpm
        over_tokens = bool(tpm) and windows.tokens.used(now) >= tpm
        if over_requests or over_tokens:
            wait_ms = max(
                limits.reset_requests_ms if over_requests else 0, limits.reset_tokens_ms if over_tokens else 0
            )
            what = "requests" if over_requests else "tokens"
            limit = rpm if over_requests else tpm
            raise RateLimited(
                f"Rate limit reached for API key {key.key_id} on {what} per min: limit {limit}. "
                f"Please try again in {wait_ms / 1000:.3g}s.",
                retry_after_seconds=max(1, math.ceil(wait_ms / 1000)),
                error_type=what,
                rate_limits=limits,
            )
        windows.requests.add(now, 1)

    def recorded(self, record: usage_pb2.UsageRecord) -> None:
        """A call's usage reached the ledger: its tokens count now, and its key's monthly spend is
        read again at the next admission rather than taken from the cache."""
        if not record.api_key_id:
            return
        tokens = record.prompt_tokens + record.completion_tokens
        self._windows.setdefault(record.api_key_id, _KeyWindows()).tokens.add(self._clock_ms(), tokens)
        self._spend.pop(record.api_key_id, None)

    def rate_limits(self, key: ApiKey, now_ms: int | None = None) -> bridge_pb2.RateLimits:
        """The key's per-minute limits and what is left of them now."""
        now = self._clock_ms() if now_ms is None else now_ms
        windows = self._windows.setdefault(key.key_id, _KeyWindows())
        rpm, tpm = key.limits.requests_per_minute, key.limits.tokens_per_minute
        limits = bridge_pb2.RateLimits(limit_requests=rpm, limit_tokens=tpm)
        if rpm:
            limits.remaining_requests = max(0, rpm - windows.requests.used(now))
            limits.reset_requests_ms = windows.requests.ms_until_under(rpm, now)
        if tpm:
            limits.remaining_tokens = max(0, tpm - windows.tokens.used(now))
            limits.reset_tokens_ms = windows.tokens.ms_until_under(tpm, now)
        return limits

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
