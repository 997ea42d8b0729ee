"""Replay a prefix-reuse trace through the router's real placement and the cache's real index.

Per request, in timestamp order (ties keep file order):

1. every replica drops the requests that finished by now (``ServiceTimeModel``),
   giving the ``ReplicaLoad`` snapshot placement sees (in-flight requests);
2. the ``PrefixIndex``, fed only by the replicas' own stored/removed events,
   answers how many leading blocks each replica holds (cache-aware policies only);
3. the policy picks a replica; the replica serves the request through its
   BlockPool (the truth about hits, whatever the index believed) and publishes
   its events to the index.

Policies:

* ``affinity``: ``choose_replica`` with the request's ``session_id`` (rendezvous
  hashing with bounded load, failing over to the cached prefix); a request
  without one is placed as in ``cache-aware``, as the router does.
* ``cache-aware``: ``choose_replica`` with no session: cached tokens minus a
  load penalty.
* ``round-robin``: request *i* goes to replica *i mod n*; the floor.
* ``random``: a uniform replica from ``random.Random(seed)``.

Figures:

* ``cached_token_ratio``: prompt tokens served from cache / all prompt tokens.
* ``ideal_cached_token_ratio``: the same with one unlimited cache that has seen
  every earlier request (no placement, no eviction): the most any policy can get.
* ``max_load_over_mean``: per replica, load = tokens it computed (uncached prompt
  tokens plus generated tokens); the busiest replica's over the mean. 1.0 is a
  perfect balance; with 4 replicas, 4.0 means one replica did everything.
* ``cost_usd``: what the trace is billed at the model's prices (the usage
  service's ``ModelPrice``: by default $0.60 / 1M input, $0.10 / 1M cached input,
  $3.00 / 1M output), cached tokens from any tier at the cached price;
  ``saving_usd``: the same trace with nothing cached, minus that.

Tiers (``--host-blocks-per-replica``, ``--shared-blocks``): each replica's pool
demotes what it evicts to a host tier of its own, and every replica writes what it
computes to one shared tier; a prefix found there is loaded, not recomputed (see
``simulated_replica.py``).

Retention (``--session-retention-seconds``): a request with a session id and no retention of
its own is retained for the operator's session default (the router's
``CACHET_ROUTER_SESSION_CACHE_RETENTION``, ``in_memory`` = 600 s unless told otherwise); one
whose trace line says ``retention_seconds`` gets that instead (0: none). Its whole blocks are
then kept in preference to others until it would finish plus that long, in trace time, as the
engine keeps them (see ``simulated_replica.py``). Every policy is replayed twice, with
retention and with none at all (plain LRU everywhere): ``without_retention`` holds the
second run's figures, the same object as the first when no request is retained.
"""

from __future__ import annotations

import itertools
import random
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from cachet.cache.prefix_index import PrefixIndex
from cachet.engine.block_pool import AllBlocksCleared, BlocksRemoved, BlocksStored, KvEvent
from cachet.engine.kv_retention import MAX_RETENTION_SECONDS
from cachet.router.cache_retention import RETENTION_SECONDS
from cachet.router.placement import PlacementPolicy, ReplicaLoad, choose_replica
from cachet.router.session_directory import SessionDirectory
from cachet.router.v1 import router_pb2
from cachet.tools.lru_tier import LruTier
from cachet.tools.simulated_replica import ServiceTimeModel, SimulatedReplica
from cachet.tools.trace import TraceRequest
from cachet.usage.prices import ModelPrice

POLICIES = ("affinity", "cache-aware", "round-robin", "random")
# Every simulated replica serves this one model; the index keys blocks by model.
MODEL = "replay"
DEFAULT_BLOCK_TOKENS = 512
# 4,096 blocks of 512 tokens = 2M tokens of KV per replica (a GPU's HBM plus a host-memory tier).
DEFAULT_BLOCKS_PER_REPLICA = 4096
# The router's default for a request with a session id that asks no retention of its own
# (CACHET_ROUTER_SESSION_CACHE_RETENTION = in_memory): 10 minutes.
DEFAULT_SESSION_RETENTION_SECONDS = float(RETENTION_SECONDS[router_pb2.CACHE_RETENTION_IN_MEMORY])


@dataclass(frozen=True)
class ReplayConfig:
    replicas: int = 4
    blocks_per_replica: int = DEFAULT_BLOCKS_PER_REPLICA
    block_tokens: int = DEFAULT_BLOCK_TOKENS
    # Tiers below the pools: a host tier per replica, one shared tier; 0 = none.
    host_blocks_per_replica: int = 0
    shared_blocks: int = 0
    # Retention of a request with a session id and none of its own; 0 = none.
    session_retention_s: float = DEFAULT_SESSION_RETENTION_SECONDS
    # False: no request is retained, whatever it asked (plain LRU in every tier).
    retention: bool = True
    price: ModelPrice = ModelPrice()
    # Seeds the ``random`` policy only; every other policy is deterministic.
    seed: int = 0
    service: ServiceTimeModel = ServiceTimeModel()
    placement: PlacementPolicy = PlacementPolicy()

    def __post_init__(self) -> None:
        if self.replicas < 1 or self.blocks_per_replica < 1 or self.block_tokens < 1:
            raise ValueError("replicas, blocks_per_replica and block_tokens must be positive")
        if self.host_blocks_per_replica < 0 or self.shared_blocks < 0:
            raise ValueError("host_blocks_per_replica and shared_blocks cannot be negative")
        if not 0 <= self.session_retention_s <= MAX_RETENTION_SECONDS:
            raise ValueError(f"session_retention_s must be in [0, {MAX_RETENTION_SECONDS}]")


@dataclass(frozen=True)
class PolicyFigures:
    """One policy's replay."""

    policy: str
    cached_token_ratio: float
    max_load_over_mean: float
    # Per replica, in address order: tokens computed and requests served.
    computed_tokens: tuple[int, ...]
    requests: tuple[int, ...]
    # How often each placement reason was given ("session", "score", "round-robin", ...).
    reasons: Mapping[str, int] = field(default_factory=dict)
    # Of the cached prompt tokens, those loaded from the host and the shared tier.
    host_cached_tokens: int = 0
    shared_cached_tokens: int = 0
    # Billed at the model's prices, and what caching saved against none (pico-USD: exact).
    cost_picousd: int = 0
    saving_picousd: int = 0

    @property
    def cost_usd(self) -> float:
        return self.cost_picousd / 1e12

    @property
    def saving_usd(self) -> float:
        return self.saving_picousd / 1e12


@dataclass(frozen=True)
class ReplayReport:
    requests: int
    input_tokens: int
    ideal_cached_token_ratio: float
    # Each policy with retention as configured, and with none at all.
    policies: Mapping[str, PolicyFigures]
    without_retention: Mapping[str, PolicyFigures]
    # Requests that were retained (a session default or their own retention), and the default.
    retained_requests: int = 0
    session_retention_s: float = DEFAULT_SESSION_RETENTION_SECONDS

    def to_json(self) -> dict[str, object]:
        """The ``cachet replay --json`` object: exactly these keys, nothing else."""
        return {
            "ideal_cached_token_ratio": self.ideal_cached_token_ratio,
            "session_retention_seconds": self.session_retention_s,
            "retained_requests": self.retained_requests,
            "policies": {
                name: {
                    **_figures_json(figures),
                    "without_retention": _figures_json(self.without_retention[name]),
                }
                for name, figures in self.policies.items()
            },
        }


def _figures_json(figures: PolicyFigures) -> dict[str, float]:
    return {
        "cached_token_ratio": figures.cached_token_ratio,
        "max_load_over_mean": figures.max_load_over_mean,
        "cost_usd": figures.cost_usd,
        "saving_usd": figures.saving_usd,
    }


def replay(
    trace: Sequence[TraceRequest], config: ReplayConfig = ReplayConfig(), policies: Sequence[str] = POLICIES
) -> ReplayReport:
    """Replay ``trace`` once per policy, each on fresh replicas and a fresh index; once more
    without retention when any request is retained."""
    ordered = in_time_order(trace)
    input_tokens = sum(request.input_length for request in ordered)
    retained = sum(1 for request in ordered if retention_seconds(request, config) > 0)
    figures = _replay_policies(ordered, policies, config)
    return ReplayReport(
        requests=len(ordered),
        input_tokens=input_tokens,
        ideal_cached_token_ratio=_ratio(ideal_cached_tokens(ordered, config.block_tokens), input_tokens),
        policies=figures,
        without_retention=(
            _replay_policies(ordered, policies, replace(config, retention=False)) if retained else figures
        ),
        retained_requests=retained,
        session_retention_s=config.session_retention_s if config.retention else 0.0,
    )


def retention_seconds(request: TraceRequest, config: ReplayConfig) -> float:
    """How long a request's KV is retained: its own ask, else the session default if it has a session."""
    if not config.retention:
        return 0.0
    if request.retention_seconds is not None:
        return request.retention_seconds
    return config.session_retention_s if request.session_id else 0.0


def _replay_policies(
    trace: Sequence[TraceRequest], policies: Sequence[str], config: ReplayConfig
) -> dict[str, PolicyFigures]:
    figures: dict[str, PolicyFigures] = {}
    reuse = "cache-aware" in policies and not any(request.session_id for request in trace)
    for policy in policies:
        if policy == "affinity" and reuse:
            continue
        figures[policy] = replay_policy(trace, policy, config)
    if reuse and "affinity" in policies:
        # With no session anywhere, affinity runs choose_replica exactly as cache-aware does.
        figures["affinity"] = replace(figures["cache-aware"], policy="affinity")
    return {policy: figures[policy] for policy in policies}


def in_time_order(trace: Sequence[TraceRequest]) -> list[TraceRequest]:
    # sorted() is stable: requests with equal timestamps keep their file order.
    return sorted(trace, key=lambda request: request.timestamp_ms)


def ideal_cached_tokens(trace: Sequence[TraceRequest], block_tokens: int) -> int:
    """Prompt tokens one unlimited prefix cache would serve, replaying ``trace`` in the order given."""
    seen: set[int] = set()
    cached = 0
    for request in trace:
        hits = _leading_run(request.hash_ids, seen)
        cached += min(hits * block_tokens, request.input_length)
        seen.update(request.hash_ids)
    return cached


def replay_policy(trace: Sequence[TraceRequest], policy: str, config: ReplayConfig) -> PolicyFigures:
    """Replay ``trace`` (already in time order) with one policy."""
    shared = LruTier(config.shared_blocks)
    replicas = [
        SimulatedReplica(
            f"replica-{i}",
            num_blocks=config.blocks_per_replica,
            block_tokens=config.block_tokens,
            service=config.service,
            host_blocks=config.host_blocks_per_replica,
            shared=shared,
        )
        for i in range(config.replicas)
    ]
    by_address = {replica.address: replica for replica in replicas}
    index = PrefixIndex()
    choose = _chooser(policy, config, [replica.address for replica in replicas])
    reasons: Counter[str] = Counter()
    for request in trace:
        loads = [replica.load(request.timestamp_ms) for replica in replicas]
        address, reason = choose(request, loads, index)
        reasons[reason] += 1
        replica = by_address[address]
        replica.serve(
            request.hash_ids,
            request.input_length,
            request.output_length,
            request.timestamp_ms,
            retention_s=retention_seconds(request, config),
        )
        publish(index, address, replica.take_events())
    computed = tuple(replica.computed_tokens for replica in replicas)
    cached = sum(replica.cached_tokens for replica in replicas)
    prompt = sum(request.input_length for request in trace)
    output = sum(request.output_length for request in trace)
    return PolicyFigures(
        policy=policy,
        cached_token_ratio=_ratio(cached, prompt),
        max_load_over_mean=max_over_mean(computed),
        computed_tokens=computed,
        requests=tuple(replica.requests for replica in replicas),
        reasons=dict(reasons),
        host_cached_tokens=sum(replica.host_tokens for replica in replicas),
        shared_cached_tokens=sum(replica.shared_tokens for replica in replicas),
        cost_picousd=config.price.cost_picousd(prompt, cached, output),
        saving_picousd=config.price.cache_savings_picousd(cached),
    )


def publish(index: PrefixIndex, address: str, events: Sequence[KvEvent]) -> None:
    """Apply one replica's KV events to the index, as the cache service's follower does."""
    for event in events:
        if isinstance(event, BlocksStored):
            index.apply_stored(address, MODEL, event.block_hashes)
        elif isinstance(event, BlocksRemoved):
            index.apply_removed(address, event.block_hashes)
        elif isinstance(event, AllBlocksCleared):
            index.clear(address)


def max_over_mean(loads: Sequence[int]) -> float:
    """The busiest replica's load over the mean; 1.0 when there is no load at all."""
    total = sum(loads)
    return max(loads) * len(loads) / total if total else 1.0


# A policy: (request, replica loads, index) -> (address, reason).
Chooser = Callable[[TraceRequest, Sequence[ReplicaLoad], PrefixIndex], tuple[str, str]]


def _chooser(policy: str, config: ReplayConfig, addresses: Sequence[str]) -> Chooser:
    if policy in ("affinity", "cache-aware"):
        # The router's own session directory: homes and KV footprints of live sessions.
        sessions = SessionDirectory() if policy == "affinity" else None

        def placed(
            request: TraceRequest, loads: Sequence[ReplicaLoad], index: PrefixIndex
        ) -> tuple[str, str]:
            matches = index.match(MODEL, request.hash_ids)
            # Cached tokens as the router computes them: whole matched blocks.
            cached = {match.address: match.matched_blocks * config.block_tokens for match in matches}
            if sessions is None or not request.session_id:
                placement = choose_replica(loads, cached, policy=config.placement)
                return placement.address, placement.reason
            now = request.timestamp_ms / 1000.0
            placement = choose_replica(
                loads,
                cached,
                session_id=request.session_id,
                session_home=sessions.home(request.session_id, now),
                footprints=sessions.footprints(now),
                policy=config.placement,
            )
            sessions.record(request.session_id, placement.address, request.input_length, now)
            return placement.address, placement.reason

        return placed
    if policy == "round-robin":
        turn = itertools.count()
        return lambda request, loads, index: (addresses[next(turn) % len(addresses)], "round-robin")
    if policy == "random":
        draw = random.Random(config.seed)
        return lambda request, loads, index: (draw.choice(addresses), "random")
    raise ValueError(f"unknown policy {policy!r}; choose from {', '.join(POLICIES)}")


def _leading_run(hash_ids: Sequence[int], seen: set[int]) -> int:
    """How many leading ids are in ``seen``."""
    for i, block_hash in enumerate(hash_ids):
        if block_hash not in seen:
            return i
    return len(hash_ids)


def _ratio(part: int, whole: int) -> float:
    return part / whole if whole else 0.0


def format_report(report: ReplayReport, config: ReplayConfig) -> str:
    """A table for people: one line per policy, plus the ideal."""
    ideal = report.ideal_cached_token_ratio
    tiers = (
        f" (+ {config.host_blocks_per_replica} host blocks each, {config.shared_blocks} shared blocks)"
        if config.host_blocks_per_replica or config.shared_blocks
        else ""
    )
    lines = [
        f"{report.requests} requests, {report.input_tokens} prompt tokens; {config.replicas} replicas × "
        f"{config.blocks_per_replica} blocks of {config.block_tokens} tokens{tiers}",
        f"ideal cached-token ratio (one unlimited cache): {ideal:.4f}",
        f"retained: {report.retained_requests} requests (session default {report.session_retention_s:g} s)",
        "",
        f"{'policy':<13}{'cached ratio':>13}{'× ideal':>9}{'from host':>10}{'from shared':>12}"
        f"{'load max/mean':>15}{'cost $':>10}{'saved $':>10}{'no retention':>13}{'cost $':>10}  placements",
    ]
    for figures in report.policies.values():
        of_ideal = figures.cached_token_ratio / ideal if ideal else 0.0
        without = report.without_retention[figures.policy]
        reasons = ", ".join(f"{reason} {count}" for reason, count in sorted(figures.reasons.items()))
        lines.append(
            f"{figures.policy:<13}{figures.cached_token_ratio:>13.4f}{of_ideal:>9.3f}"
            f"{_ratio(figures.host_cached_tokens, report.input_tokens):>10.4f}"
            f"{_ratio(figures.shared_cached_tokens, report.input_tokens):>12.4f}"
            f"{figures.max_load_over_mean:>15.3f}{figures.cost_usd:>10.2f}{figures.saving_usd:>10.2f}"
            f"{without.cached_token_ratio:>13.4f}{without.cost_usd:>10.2f}  {reasons}"
        )
    lines.append("")
    lines.append("load = tokens a replica computed (uncached prompt + generated); 1.0 = perfectly even")
    lines.append("from host / shared: share of all prompt tokens loaded from that tier (counted as cached)")
    lines.append("no retention: the cached ratio and cost of the same replay with no request retained")
    return "\n".join(lines)
