"""A value per model asked of another service once and kept: a model's vocabulary never changes."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class FetchedOnce(Generic[T]):
    """``fetch(model)``'s answer, kept per model.

    Requests that arrive while the first fetch runs wait for that one rather than each
    asking again (the tokenizer's export is a few MB); a fetch that failed is tried again by
    the next request, so a tokenizer that was down at start-up costs only the requests that
    came while it was.
    """

    def __init__(self, fetch: Callable[[str], Awaitable[T]]) -> None:
        self._fetch = fetch
        self._fetches: dict[str, asyncio.Future[T]] = {}

    async def get(self, model: str) -> T:
        fetch = self._fetches.get(model)
        if fetch is not None and fetch.done() and not fetch.cancelled() and fetch.exception() is None:
            return fetch.result()
        if fetch is None or fetch.done():
            fetch = self._fetches[model] = asyncio.ensure_future(self._fetch(model))
        try:
            # Shielded: one waiting request going away must not cancel the others' fetch.
            return await asyncio.shield(fetch)
        except BaseException:
            failed = fetch.done() and (fetch.cancelled() or fetch.exception() is not None)
            if failed and self._fetches.get(model) is fetch:
                del self._fetches[model]
            raise
