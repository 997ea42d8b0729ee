"""Per-key minute windows: the same contract in a router's memory and in PostgreSQL, and on
PostgreSQL one count for every router sharing the database."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from cachet.router.key_limits import KeyWindows, MemoryKeyWindows
from cachet.router.postgres_key_windows import PostgresKeyWindows

NOW = 1_700_000_000_000


@pytest.fixture(params=["memory", "postgresql"])
def windows_url(request: pytest.FixtureRequest) -> str:
    return "" if request.param == "memory" else request.getfixturevalue("postgres_url")


@pytest.fixture
async def windows(windows_url: str) -> AsyncIterator[KeyWindows]:
    opened: KeyWindows = await PostgresKeyWindows.open(windows_url) if windows_url else MemoryKeyWindows()
    yield opened
    await opened.close()


async def test_requests_pass_until_the_limit_and_again_a_minute_later(windows: KeyWindows) -> None:
    assert (await windows.admit("key_a", NOW, 2, 0))[0]
    assert (await windows.admit("key_a", NOW + 10_000, 2, 0))[0]
    admitted, use = await windows.admit("key_a", NOW + 20_000, 2, 0)
    assert not admitted
    limits = use.rate_limits(2, 0, NOW + 20_000)
    assert (limits.remaining_requests, limits.reset_requests_ms) == (0, 40_000)
    assert (await windows.admit("key_b", NOW + 20_000, 2, 0))[0]  # another key counts apart
    assert (await windows.admit("key_a", NOW + 60_000, 2, 0))[0]


async def test_tokens_count_against_the_token_limit(windows: KeyWindows) -> None:
    assert (await windows.admit("key_t", NOW, 0, 100))[0]
    await windows.add_tokens("key_t", NOW + 1_000, 100)
    admitted, use = await windows.admit("key_t", NOW + 2_000, 0, 100)
    assert not admitted and use.rate_limits(0, 100, NOW + 2_000).remaining_tokens == 0
    assert (await windows.admit("key_t", NOW + 61_000, 0, 100))[0]


async def test_routers_sharing_a_database_share_each_key_s_limit(postgres_url: str) -> None:
    first, second = await PostgresKeyWindows.open(postgres_url), await PostgresKeyWindows.open(postgres_url)
    try:
        # Twenty calls at once, half through each router, against a limit of five.
        calls = [(first if n % 2 else second).admit("key_shared", NOW + n, 5, 0) for n in range(20)]
        outcomes = await asyncio.gather(*calls)
        assert sum(admitted for admitted, _ in outcomes) == 5
        await first.add_tokens("key_shared", NOW + 100, 50)
        admitted, use = await second.admit("key_other", NOW + 200, 0, 50)
        assert admitted
        refused, use = await second.admit("key_shared", NOW + 200, 0, 50)
        assert not refused and use.tokens.used(NOW + 200) == 50
    finally:
        await first.close()
        await second.close()
