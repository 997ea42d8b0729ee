"""A settable clock (milliseconds) for the queue store, so lease expiry is tested without sleeping."""

from __future__ import annotations


class Clock:
    def __init__(self) -> None:
        self.now_ms = 1_000_000

    def __call__(self) -> int:
        return self.now_ms
