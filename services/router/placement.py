"""Which engine replica serves a request: pure functions over a snapshot of the replicas.

Two rules, one per kind of request:

* **With a session id** (``x-session-affinity``): rendezvous (highest-random-weight)
  hashing ranks every configured replica for the session, so a session keeps its
  replica, and when a replica comes or goes only the sessions ranked first on it
  move. Load is bounded (consistent hashing with bounded loads, Mirrokni et al.):
  a replica whose load would exceed ``ceil((1 + eps) * (total + 1) / n)`` is
  skipped and the session spills to its next replica in rendezvous order, so one
  hot session cannot pile its traffic on one replica. If the session's own replica
  is gone or saturated, the session has no home to keep: it goes wherever the
  longest cached prefix is (the scoring rule below), which is most likely the
  replica it spilled to last time.
* **Without a session**: score = cached prefix tokens − ``load_penalty_tokens`` × load;
  highest score wins, ties go to the least loaded replica, then to the lowest
  address so that equal inputs always give equal answers.

Saturated replicas (see ``ReplicaLoad.saturated``) are never chosen. When every
replica is saturated the request is refused at once with ``ResourceExhausted``:
a synchronous request never waits without bound for capacity.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

from cachet.errors import ResourceExhausted, Unavailable


@dataclass(frozen=True)
class ReplicaLoad:
    """One available replica as placement sees it (a snapshot; never mutated)."""

    address: str
    running: int
    waiting: int
    max_running: int
    max_waiting: int
    # Of running and waiting, queued jobs (batch priority).
    batch_running: int = 0
    batch_waiting: int = 0

    @property
    def load(self) -> int:
        """Requests the replica holds: running plus waiting."""
        return self.running + self.waiting

    @property
    def saturated(self) -> bool:
        """True when a new request could not start soon.

        Either the waiting queue is full (the engine would refuse the request with
        RESOURCE_EXHAUSTED anyway), or the running batch is full of interactive
        requests and interactive ones are already queued behind it (a new one would
        wait for a whole generation to finish before its first token). Queued jobs
        count for neither: the engine preempts one to seat an interactive arrival,
        so seats they hold, and jobs waiting for a seat, never keep interactive
        traffic out. A full batch with an empty queue is not saturated either: the
        next finishing request frees a slot within one decode step.
        """
        if self.max_waiting and self.waiting >= self.max_waiting:
            return True
        interactive_running = self.running - self.batch_running
        interactive_waiting = self.waiting - self.batch_waiting
        return bool(self.max_running) and interactive_running >= self.max_running and interactive_waiting > 0


@dataclass(frozen=True)
class PlacementPolicy:
    """Knobs of the placement rules."""

    # Bounded-load slack: a session's replica may carry up to (1 + eps) × its fair share.
    # 1.0 from `cachet replay` on the agent trace (4 replicas): eps 0.25 spilled ~3% of
    # turns off their home (0.973x the ideal cached ratio), eps 1.0 none (1.000x) at a
    # max/mean load of 1.14 instead of 1.10.
    load_epsilon: float = 1.0
    # Cached prefix tokens that one request already on a replica is worth: a replica with
    # 3 more requests must hold 3 × this many more cached tokens to win. 512 from the same
    # replay: at 128 cache-aware placement piled work up (max/mean load 1.45 for 1.000x the
    # ideal); at 512 it keeps 0.998x at 1.06; at 2048 hits fall to 0.974x.
    load_penalty_tokens: float = 512.0
    # What a refused caller is told to wait before retrying.
    retry_after_seconds: int = 1


@dataclass(frozen=True)
class Placement:
    """The chosen replica and why (the reason goes to logs and metrics)."""

    address: str
    reason: str  # "session", "session_spill", "session_failover" or "score"


def rendezvous_weight(session_id: str, address: str) -> int:
    """The session's weight for a replica; stable across processes and restarts."""
    digest = hashlib.blake2b(f"{session_id}\0{address}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def rendezvous_order(session_id: str, addresses: Collection[str]) -> list[str]:
    """Replicas from the session's first choice to its last."""
    return sorted(addresses, key=lambda address: (-rendezvous_weight(session_id, address), address))


def bounded_load_capacity(replicas: Sequence[ReplicaLoad], epsilon: float) -> int:
    """Most requests one replica may hold, counting the request being placed."""
    total = sum(replica.load for replica in replicas) + 1
    return math.ceil((1.0 + epsilon) * total / len(replicas))


def choose_replica(
    replicas: Sequence[ReplicaLoad],
    cached_tokens: Mapping[str, int],
    *,
    session_id: str = "",
    all_addresses: Collection[str] = (),
    exclude: Collection[str] = (),
    policy: PlacementPolicy = PlacementPolicy(),
) -> Placement:
    """Pick the replica for one request.

    ``replicas`` are the available ones (healthy, reporting); ``all_addresses`` are
    every configured replica, available or not, so that a session's home is the same
    whether or not its replica is up right now. ``cached_tokens`` maps an address to
    the prompt tokens it holds cached. ``exclude`` names replicas already tried.
    """
    candidates = [replica for replica in replicas if replica.address not in exclude]
    if not candidates:
        raise Unavailable("no engine replica is available for this model")
    open_replicas = [replica for replica in candidates if not replica.saturated]
    if not open_replicas:
        raise ResourceExhausted(
            "every engine replica is at capacity; retry shortly",
            retry_after_seconds=policy.retry_after_seconds,
        )
    if session_id:
        return _place_session(session_id, candidates, open_replicas, cached_tokens, all_addresses, policy)
    return Placement(_best_scored(open_replicas, cached_tokens, policy).address, "score")


def _place_session(
    session_id: str,
    candidates: Sequence[ReplicaLoad],
    open_replicas: Sequence[ReplicaLoad],
    cached_tokens: Mapping[str, int],
    all_addresses: Collection[str],
    policy: PlacementPolicy,
) -> Placement:
    by_address = {replica.address: replica for replica in open_replicas}
    order = rendezvous_order(session_id, {*all_addresses, *(r.address for r in candidates)})
    if order[0] not in by_address:
        # Home is down, excluded or saturated: follow the session's cached prefix instead.
        return Placement(_best_scored(open_replicas, cached_tokens, policy).address, "session_failover")
    capacity = bounded_load_capacity(candidates, policy.load_epsilon)
    for rank, address in enumerate(order):
        replica = by_address.get(address)
        if replica is not None and replica.load + 1 <= capacity:
            return Placement(address, "session" if rank == 0 else "session_spill")
    # Every open replica is over the bound (the light ones are saturated): still serve.
    return Placement(_best_scored(open_replicas, cached_tokens, policy).address, "session_spill")


def _best_scored(
    replicas: Sequence[ReplicaLoad], cached_tokens: Mapping[str, int], policy: PlacementPolicy
) -> ReplicaLoad:
    def rank(replica: ReplicaLoad) -> tuple[float, int, str]:
        score = cached_tokens.get(replica.address, 0) - policy.load_penalty_tokens * replica.load
        # min() over (−score, load, address): best score, then least loaded, then lowest address.
        return (-score, replica.load, replica.address)

    return min(replicas, key=rank)
