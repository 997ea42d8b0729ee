"""Which engine replica serves a request: pure functions over a snapshot of the replicas.

Every request is scored: cached prefix tokens − ``load_penalty_tokens`` × load. A token
cached in a lower KV tier (host memory, the shared file tier) counts for less than one in the
engine's pool, by the share of the prefill each saves (``prefix_value``): at equal length
the pool beats the host tier, which beats the shared tier, and anything beats nothing.
The penalty is what moving costs against what it saves: a replica holding 3 more
requests must hold 3 × the penalty more cached tokens to win, so a request leaves
the replica that holds its prefix only when the queue it would wait in there costs
more than recomputing the prefix elsewhere.

* **Without a session**: the highest score wins; ties go to the least loaded
  replica, then to the lowest address, so that equal inputs give equal answers.
* **With a session id** (``x-session-affinity`` or ``prompt_cache_key``): a strong
  hint, not a blind hash. The score decides first, exactly as without a session,
  so the session goes where its prefix actually is (the cache index says) and
  moves only when that pays. What the session id adds is the choice among
  replicas that score within ``session_slack_tokens`` of the best (every replica
  when the session's prefix is gone, or when it is new: then within
  ``new_session_slack_tokens``, so that a system prompt cached for others does not
  draw every new session to one replica): the least loaded, then the one whose
  live sessions hold the fewest KV tokens (``session_directory.py``), then the
  session's rendezvous order, a stable answer that another router process gives
  too. When the index said nothing at all (down, or no block cached anywhere), the
  session stays on its home, where its last request went, unless that is saturated
  or gone.
  A blind rendezvous hash with bounded loads, which this replaced, lost 5% of the
  cached tokens of real agent sessions to spills onto replicas that held nothing
  of theirs (issue 25); preferring the home over a less loaded replica when the
  index showed the home had lost the session's prefix cost 0.6% of the cached
  tokens in the replay of 256 Claude Code sessions on too little KV
  (docs/benchmarks.md).

Saturated replicas (see ``ReplicaLoad.saturated``) are never chosen. When every
replica is saturated the request is refused at once with ``ResourceExhausted``:
a synchronous request never waits without bound for capacity.
"""

from __future__ import annotations

import hashlib
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

    # Cached prefix tokens that one request already on a replica is worth: a replica with
    # 3 more requests must hold 3 × this many more cached tokens to win. 512 from `cachet
    # replay` on the synthetic agent trace: at 128 cache-aware placement piled work up (max/mean
    # load 1.45 for 1.000x the ideal); at 512 it keeps 0.998x at 1.06; at 2048 hits fall to 0.974x.
    load_penalty_tokens: float = 512.0
    # A session chooses by load, then KV footprint, among replicas that score within this of
    # the best. 0: exact ties only. 512 (a request's worth) cost up to 0.3% of the cached
    # tokens against keyless placement on the synthetic agent trace, moving young sessions
    # off a home one request busier, and gained nothing on the Claude Code replay.
    session_slack_tokens: float = 0.0
    # The same for a session with no home yet (new, or idle past the directory's memory):
    # what it may give up of a prefix cached for others (a shared system prompt and tools)
    # to land where the sessions' KV is smallest. Without it every new session follows the
    # shared prefix to the first replica that cached it.
    new_session_slack_tokens: float = 32_768.0
    # What a cached token is worth in a lower tier, against one in the engine's pool (1.0): the
    # prefill time it saves over the time a pool hit saves. docs/ARCHITECTURE.md's `make bench`
    # kv_tiers figures (2,000-token prompt, CPU, bf16) put a prompt's TTFT at ~0.02x of cold from
    # a pool hit, 0.02-0.04x from the host tier and ~0.05x from the shared tier: a token saves
    # 0.98, 0.96 (the slower end) and 0.95 of its cost, so 0.96/0.98 and 0.95/0.98.
    host_tier_weight: float = 0.98
    shared_tier_weight: float = 0.97
    # What a refused caller is told to wait before retrying.
    retry_after_seconds: int = 1


@dataclass(frozen=True)
class Placement:
    """The chosen replica and why (the reason goes to logs and metrics)."""

    address: str
    # "score" (no session); "session" (its home), "session_new" (no home: by load and KV),
    # "session_move" (its home lost on score, or is gone).
    reason: str


def prefix_value(engine_tokens: int, host_tokens: int, shared_tokens: int, policy: PlacementPolicy) -> float:
    """A replica's cached prefix in pool tokens: its pool run, then the host and shared runs that
    continue it (``cache.PrefixIndex.match``), each token weighted by what its tier saves."""
    return engine_tokens + policy.host_tier_weight * host_tokens + policy.shared_tier_weight * shared_tokens


def rendezvous_weight(session_id: str, address: str) -> int:
    """The session's weight for a replica; stable across processes and restarts."""
    digest = hashlib.blake2b(f"{session_id}\0{address}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def rendezvous_order(session_id: str, addresses: Collection[str]) -> list[str]:
    """Replicas from the session's first choice to its last."""
    return sorted(addresses, key=lambda address: (-rendezvous_weight(session_id, address), address))


def choose_replica(
    replicas: Sequence[ReplicaLoad],
    cached_tokens: Mapping[str, float],
    *,
    session_id: str = "",
    session_home: str = "",
    footprints: Mapping[str, int] | None = None,
    exclude: Collection[str] = (),
    policy: PlacementPolicy = PlacementPolicy(),
) -> Placement:
    """Pick the replica for one request.

    ``replicas`` are the available ones (healthy, reporting). ``cached_tokens`` maps
    an address to the prompt tokens it holds cached (``prefix_value``: tier-weighted). ``exclude`` names replicas
    already tried. For a session: ``session_home`` is where its last request went
    ("" if none) and ``footprints`` the KV tokens of the live sessions on each
    replica (``SessionDirectory``).
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
        return _place_session(
            session_id, session_home, open_replicas, cached_tokens, footprints or {}, policy
        )
    return Placement(_best_scored(open_replicas, cached_tokens, policy).address, "score")


def _score(replica: ReplicaLoad, cached_tokens: Mapping[str, float], policy: PlacementPolicy) -> float:
    return cached_tokens.get(replica.address, 0) - policy.load_penalty_tokens * replica.load


def _place_session(
    session_id: str,
    home: str,
    open_replicas: Sequence[ReplicaLoad],
    cached_tokens: Mapping[str, float],
    footprints: Mapping[str, int],
    policy: PlacementPolicy,
) -> Placement:
    if not cached_tokens and any(r.address == home for r in open_replicas):
        # The index is down or knows nothing: the home is the only sign of the session's KV.
        return Placement(home, "session")
    best = max(_score(replica, cached_tokens, policy) for replica in open_replicas)
    slack = policy.session_slack_tokens if home else policy.new_session_slack_tokens
    near = [r for r in open_replicas if _score(r, cached_tokens, policy) >= best - slack]
    rank = {address: i for i, address in enumerate(rendezvous_order(session_id, [r.address for r in near]))}
    # A session's own tokens count in the footprint of the home it may leave until the
    # directory hears of the move; that only ever favours staying.
    chosen = min(near, key=lambda r: (r.load, footprints.get(r.address, 0), rank[r.address])).address
    if chosen == home:
        return Placement(home, "session")
    return Placement(chosen, "session_move" if home else "session_new")


def _best_scored(
    replicas: Sequence[ReplicaLoad], cached_tokens: Mapping[str, float], policy: PlacementPolicy
) -> ReplicaLoad:
    def rank(replica: ReplicaLoad) -> tuple[float, int, str]:
        # min() over (−score, load, address): best score, then least loaded, then lowest address.
        return (-_score(replica, cached_tokens, policy), replica.load, replica.address)

    return min(replicas, key=rank)
