"""Requests waiting to join the running batch: interactive ones ahead of batch ones."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator

from cachet.engine.request import Request


class WaitingQueue:
    """Two FIFO queues, interactive served first.

    Preempted requests re-enter at the front of their own queue, so they resume
    before anything that arrived after them. The queue has no bound of its own:
    the scheduler bounds *new* arrivals, while preempted requests always get back in.
    """

    def __init__(self) -> None:
        self._interactive: deque[Request] = deque()
        self._batch: deque[Request] = deque()

    def __len__(self) -> int:
        return len(self._interactive) + len(self._batch)

    def __iter__(self) -> Iterator[Request]:
        yield from self._interactive
        yield from self._batch

    @property
    def num_interactive(self) -> int:
        return len(self._interactive)

    @property
    def num_batch(self) -> int:
        return len(self._batch)

    def interactive_requests(self) -> Iterator[Request]:
        yield from self._interactive

    def push(self, request: Request) -> None:
        self._queue_of(request).append(request)

    def push_front(self, request: Request) -> None:
        self._queue_of(request).appendleft(request)

    def peek(self) -> Request | None:
        """The next request to admit, without removing it."""
        for queue in (self._interactive, self._batch):
            if queue:
                return queue[0]
        return None

    def peek_ready(self) -> Request | None:
        """The first request in ``peek`` order that is ready to run (grammar compiled)."""
        return next((request for request in self if request.is_ready), None)

    def pop(self) -> Request:
        """Remove and return the request ``peek`` names."""
        return (self._interactive or self._batch).popleft()

    def remove(self, request: Request) -> None:
        """Take out a request anywhere in the queue; O(position), so cheap near the front."""
        self._queue_of(request).remove(request)

    def _queue_of(self, request: Request) -> deque[Request]:
        return self._interactive if request.interactive else self._batch
