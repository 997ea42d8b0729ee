"""Where each live session was last placed, and how much KV it keeps there.

Placement reads two things from it (``placement.choose_replica``): a session's
*home* (the replica its last request went to, preferred among equally good
ones, which keeps the session put while the cache index is down or lags), and
each replica's *footprint* (the prompt tokens of the live sessions homed there:
the KV those sessions will want back on their next turn). New sessions go where
the footprint is smallest, so that the sessions' working sets share the
replicas' KV evenly instead of by hash, and no replica's LRU has to evict a
session's prefix while its agent runs a tool.

A session is live until ``idle_seconds`` pass without a request; at most
``max_sessions`` are kept (the least recently seen go first), so memory stays
bounded whatever the clients send. It is soft state: a restarted router, or
another router process, starts empty, and the cache index still places a
returning session's turns where its prefix is. Not thread-safe: the router's
event loop owns it.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


@dataclass
class _Session:
    address: str
    tokens: int
    last_seen: float


class SessionDirectory:
    """Live sessions by id, oldest first; per-replica footprints kept as running sums."""

    def __init__(self, *, idle_seconds: float = 600.0, max_sessions: int = 100_000) -> None:
        if idle_seconds <= 0 or max_sessions < 1:
            raise ValueError("idle_seconds and max_sessions must be positive")
        self._idle = idle_seconds
        self._max = max_sessions
        self._sessions: OrderedDict[str, _Session] = OrderedDict()
        self._footprints: dict[str, int] = {}

    def home(self, session_id: str, now: float) -> str:
        """The replica the session last went to; "" for a new or expired session."""
        self._expire(now)
        session = self._sessions.get(session_id)
        return session.address if session is not None else ""

    def footprints(self, now: float) -> dict[str, int]:
        """Prompt tokens of the live sessions homed on each replica (replicas with none are absent)."""
        self._expire(now)
        return dict(self._footprints)

    def record(self, session_id: str, address: str, prompt_tokens: int, now: float) -> None:
        """The session's request of ``prompt_tokens`` went to ``address`` at ``now``."""
        old = self._sessions.pop(session_id, None)
        if old is not None:
            self._add(old.address, -old.tokens)
        self._sessions[session_id] = _Session(address, prompt_tokens, now)
        self._add(address, prompt_tokens)
        while len(self._sessions) > self._max:
            self._drop_oldest()
        self._expire(now)

    def __len__(self) -> int:
        return len(self._sessions)

    def _expire(self, now: float) -> None:
        # Sessions are kept in last-seen order, so the expired ones are all at the front.
        while self._sessions:
            oldest = next(iter(self._sessions.values()))
            if now - oldest.last_seen < self._idle:
                return
            self._drop_oldest()

    def _drop_oldest(self) -> None:
        _, session = self._sessions.popitem(last=False)
        self._add(session.address, -session.tokens)

    def _add(self, address: str, tokens: int) -> None:
        total = self._footprints.get(address, 0) + tokens
        if total:
            self._footprints[address] = total
        else:
            self._footprints.pop(address, None)

    def check_invariants(self) -> None:
        """Raise AssertionError unless the footprints are the sums of the live sessions' tokens."""
        sums: dict[str, int] = {}
        for session in self._sessions.values():
            sums[session.address] = sums.get(session.address, 0) + session.tokens
        if {a: t for a, t in sums.items() if t} != self._footprints:
            raise AssertionError("footprints differ from the sessions' tokens")
        seen = [session.last_seen for session in self._sessions.values()]
        if seen != sorted(seen):
            raise AssertionError("sessions are not in last-seen order")
