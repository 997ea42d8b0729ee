"""The router's per-model fetch: one fetch shared by concurrent first requests, failures retried."""

from __future__ import annotations

import asyncio

import pytest

from cachet.router.fetched_once import FetchedOnce


async def test_concurrent_first_requests_share_one_fetch_and_later_ones_none() -> None:
    calls: list[str] = []
    release = asyncio.Event()

    async def fetch(model: str) -> str:
        calls.append(model)
        await release.wait()
        return f"{model}-value"

    cache = FetchedOnce(fetch)
    waiting = [asyncio.create_task(cache.get("m")) for _ in range(5)]
    await asyncio.sleep(0)
    release.set()
    assert await asyncio.gather(*waiting) == ["m-value"] * 5
    assert await cache.get("m") == "m-value"
    assert await cache.get("other") == "other-value"
    assert calls == ["m", "other"]


async def test_a_failed_fetch_is_tried_again_by_the_next_request() -> None:
    answers = iter([RuntimeError("tokenizer down"), "value"])

    async def fetch(model: str) -> str:
        answer = next(answers)
        if isinstance(answer, Exception):
            raise answer
        return answer

    cache = FetchedOnce(fetch)
    with pytest.raises(RuntimeError, match="tokenizer down"):
        await cache.get("m")
    assert await cache.get("m") == "value"


async def test_one_waiter_going_away_does_not_cancel_the_others_fetch() -> None:
    release = asyncio.Event()

    async def fetch(model: str) -> str:
        await release.wait()
        return "value"

    cache = FetchedOnce(fetch)
    leaving, staying = asyncio.create_task(cache.get("m")), asyncio.create_task(cache.get("m"))
    await asyncio.sleep(0)
    leaving.cancel()
    release.set()
    assert await staying == "value"
    with pytest.raises(asyncio.CancelledError):
        await leaving
