"""Per-key requests and tokens a minute: sliding windows, what is left, when it resets."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from cachet.router.api_keys import KeyLimits, new_api_key
from cachet.router.caller import Caller
from cachet.router.key_limits import KeyLimiter, QuotaExceeded, RateLimited, SlidingWindow, month_bounds_ms
from cachet.usage.v1 import usage_pb2, usage_pb2_grpc


class Clock:
    def __init__(self) -> None:
        self.now_ms = 1_000_000

    def __call__(self) -> int:
        return self.now_ms


def limiter(clock: Clock) -> KeyLimiter:
    # No budget in these keys, so the usage service is never called: nothing listens there.
    channel = grpc.aio.insecure_channel("127.0.0.1:1")
    return KeyLimiter(
        usage_pb2_grpc.UsageServiceStub(channel), budget_cache_seconds=0, timeout_seconds=1, clock_ms=clock
    )


def keyed(clock: Clock, **limits: int) -> Caller:
    _, record = new_api_key("acct-a", "", clock.now_ms, limits=KeyLimits(**limits))
    return Caller("acct-a", "", record)


def test_a_window_forgets_what_is_a_minute_old() -> None:
    window = SlidingWindow()
    window.add(0, 3)
    window.add(20_000, 2)
    assert window.used(59_999) == 5
    assert window.ms_until_under(5, 30_000) == 30_000  # the 3 at t=0 leave at t=60 s
    assert window.ms_until_under(2, 30_000) == 50_000  # both must leave
    assert window.ms_until_under(6, 30_000) == 0
    assert window.used(60_000) == 2


async def test_requests_over_the_limit_are_refused_until_the_oldest_leaves() -> None:
    clock = Clock()
    limits = limiter(clock)
    caller = keyed(clock, requests_per_minute=2)
    await limits.admit(caller)
    clock.now_ms += 10_000
    await limits.admit(caller)
    with pytest.raises(RateLimited) as refused:
        await limits.admit(caller)
    info = refused.value.error_info()
    assert info.code == "rate_limit_exceeded" and info.type == "requests"
    assert info.rate_limits.limit_requests == 2 and info.rate_limits.remaining_requests == 0
    assert info.rate_limits.reset_requests_ms == 50_000 and info.retry_after_seconds == 50
    assert refused.value.status == grpc.StatusCode.RESOURCE_EXHAUSTED
    clock.now_ms += 50_000
    await limits.admit(caller)


async def test_tokens_count_once_recorded_and_other_keys_are_apart() -> None:
    clock = Clock()
    limits = limiter(clock)
    caller, other = keyed(clock, tokens_per_minute=100), keyed(clock, tokens_per_minute=100)
    await limits.admit(caller)
    limits.recorded(
        usage_pb2.UsageRecord(api_key_id=caller.api_key_id, prompt_tokens=90, completion_tokens=10)
    )
    await asyncio.sleep(0.01)  # the count runs beside the ledger's callback
    with pytest.raises(RateLimited) as refused:
        await limits.admit(caller)
    assert refused.value.error_type == "tokens"
    assert (
        refused.value.rate_limits.remaining_tokens == 0
        and refused.value.rate_limits.reset_tokens_ms == 60_000
    )
    await limits.admit(other)
    clock.now_ms += 60_000
    await limits.admit(caller)


async def test_no_limits_no_counting() -> None:
    clock = Clock()
    limits = limiter(clock)
    for _ in range(1000):
        await limits.admit(keyed(clock))
        await limits.admit(Caller("acct-a", ""))


def test_a_month_is_a_utc_calendar_month() -> None:
    # 2026-12-31T23:59:59Z
    start, end = month_bounds_ms(1_798_761_599_000)
    assert (start, end) == (1_796_083_200_000, 1_798_761_600_000)
    assert QuotaExceeded("x").error_info().type == "insufficient_quota"
