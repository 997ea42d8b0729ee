"""An engine replica without a model: the engine's real BlockPool as its prefix cache, and a clock.

What it models, and what it leaves out:

* **KV cache**: a ``BlockPool`` of ``num_blocks`` blocks, one per trace block
  (``block_tokens`` tokens). Serving a request finds its longest cached prefix
  (``lookup`` block by block, stopping at the first miss, as the engine's KV
  cache manager does), takes those blocks, allocates the rest, names them by
  the trace's hash ids, and frees everything tail-first, exactly as a finished
  engine sequence does. So eviction is the pool's own LRU, and the pool's
  stored/removed events are the ones a real replica would publish.
* **Tiers below the pool**: a host-memory tier of the replica's own, the engine's
  ``HostTierIndex`` driven as its KV cache manager drives it (a hit there is promoted,
  then the pool's evictions are demoted; the copy orders are dropped), and a shared
  tier (``LruTier``) that every replica writes each block it computes to and reads
  from (a shared file system). A prefix continues through them past the pool's own
  hits; a block found there is loaded back into the pool (counted as cached, as
  usage bills it) instead of recomputed. Tiers are invisible to the cache index
  here: placement sees only what the pools hold.
* **Retention** (``kv_retention``): a request served with ``retention_s`` puts its
  whole blocks under retention until it would finish plus that many seconds, as the
  engine does when a request leaves the pool: the pool evicts them after every
  unretained free block (``BlockPool.retain``), a retained block it evicts is demoted
  to the host tier with its deadline, and the shared tier keeps them last too. Trace
  time is the clock: retentions due by a request's arrival end before it is served.
* **What is not modelled**: KV held by requests while they run. Blocks are taken
  and released within ``serve``, so the pool is a pure prefix cache; a request
  longer than the pool caches only the prefix that fits. Chunked prefill,
  preemption and batching slowdowns are left out too.
* **Time**: ``ServiceTimeModel`` says how long a request stays in flight; the
  in-flight count at a request's arrival is the load placement sees.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass

from cachet.engine.block_pool import BlockPool, KvEvent
from cachet.engine.host_kv_tier import HostTierIndex
from cachet.router.placement import ReplicaLoad
from cachet.tools.lru_tier import LruTier


@dataclass(frozen=True)
class ServiceTimeModel:
    """How long one request occupies a replica: ``prefill + decode``, each at a fixed rate.

    ``service_ms = computed prompt tokens / prefill rate + output tokens / decode rate``.
    Requests on one replica run side by side (continuous batching) without slowing
    each other down: the figure only has to make in-flight counts realistic, not
    latencies. The defaults are round numbers for one GPU replica of a large model:
    10,000 prefill tokens/s and 50 decode tokens/s per stream, so a cached prefix
    shortens a request and a replica's load reflects what it had to compute.
    """

    prefill_tokens_per_s: float = 10_000.0
    decode_tokens_per_s: float = 50.0

    def service_ms(self, computed_prompt_tokens: int, output_tokens: int) -> float:
        return 1000.0 * (
            computed_prompt_tokens / self.prefill_tokens_per_s + output_tokens / self.decode_tokens_per_s
        )


@dataclass(frozen=True)
class ServedRequest:
    """What serving one request cost a replica."""

    cached_tokens: int  # from every tier
    computed_tokens: int  # uncached prompt tokens plus generated tokens
    # Of cached_tokens, those loaded from the host and the shared tier.
    host_tokens: int = 0
    shared_tokens: int = 0


class SimulatedReplica:
    """One replica: a bounded LRU prefix cache (the engine's BlockPool) and its in-flight requests.

    Counters (``requests``, ``cached_tokens``, ``computed_tokens``) accumulate over
    the replay; ``load`` and ``serve`` must be called with non-decreasing times.
    """

    def __init__(
        self,
        address: str,
        *,
        num_blocks: int,
        block_tokens: int,
        service: ServiceTimeModel,
        host_blocks: int = 0,
        shared: LruTier | None = None,
    ) -> None:
        self.address = address
        self.block_tokens = block_tokens
        self.service = service
        self.pool = BlockPool(num_blocks)
        # Its events are not published (the index sees only the pools), so it keeps none.
        self.host = HostTierIndex(host_blocks, events=False) if host_blocks else None
        self.shared = shared if shared is not None else LruTier(0)
        # The pool's events since the last take_events().
        self._events: list[KvEvent] = []
        self.host_tokens = 0
        self.shared_tokens = 0
        # Finish times (ms) of the requests in flight; a min-heap, so finished ones pop first.
        self._finishes: list[float] = []
        self.requests = 0
        self.cached_tokens = 0
        self.computed_tokens = 0
        # Blocks put under retention (or kept longer) as requests left the pool.
        self.block_retentions = 0

    def load(self, now_ms: float) -> ReplicaLoad:
        """The replica as placement sees it at ``now_ms``: its in-flight requests, never saturated.

        ``max_running = 0`` means no batch limit: the simulation has no admission
        control, so every request is placed somewhere and the policies compare on
        the same requests.
        """
        while self._finishes and self._finishes[0] <= now_ms:
            heapq.heappop(self._finishes)
        return ReplicaLoad(self.address, running=len(self._finishes), waiting=0, max_running=0, max_waiting=0)

    def serve(
        self,
        hash_ids: Sequence[int],
        input_length: int,
        output_length: int,
        now_ms: float,
        retention_s: float = 0.0,
    ) -> ServedRequest:
        """Prefill one request through the prefix cache and put it in flight until it would finish;
        with ``retention_s``, its whole blocks are then retained that long past its finish."""
        self._end_retention(now_ms / 1000.0)
        hits = self._leading_hits(hash_ids)
        self.pool.touch(hits)
        # The hit blocks are now in use, so everything free can take new blocks without evicting them.
        stored = min(len(hash_ids) - len(hits), self.pool.num_free_blocks)
        # Where the pool's prefix ends, the tiers may go on; a loaded block needs a pool block too.
        new_hashes = hash_ids[len(hits) : len(hits) + stored]
        tiers = self._tier_hits(new_hashes)
        new_blocks = self.pool.allocate(stored)
        parent = hash_ids[len(hits) - 1] if hits else None
        self.pool.cache_blocks(new_blocks, new_hashes, parent)
        self._move_host_blocks(new_hashes, new_blocks, tiers)
        for block_hash in new_hashes[len(tiers) :]:
            self.shared.put(block_hash)  # written once computed
        # The trace's last block may be partial: a hit on it saves only the tokens it has.
        cached = min((len(hits) + len(tiers)) * self.block_tokens, input_length)
        device = min(len(hits) * self.block_tokens, cached)
        host = min(tiers.count("host") * self.block_tokens, cached - device)
        computed = input_length - cached + output_length
        self.requests += 1
        self.cached_tokens += cached
        self.computed_tokens += computed
        self.host_tokens += host
        self.shared_tokens += cached - device - host
        finish_ms = now_ms + self.service.service_ms(input_length - cached, output_length)
        heapq.heappush(self._finishes, finish_ms)
        if retention_s > 0:
            # Only whole blocks: the engine never names a partial one.
            whole = min(input_length // self.block_tokens, len(hits) + stored)
            self._retain(hash_ids[:whole], finish_ms / 1000.0 + retention_s)
        # Tail first, as the engine frees a finished sequence: its last blocks are evicted first.
        self.pool.free(reversed(hits + new_blocks))
        self._events.extend(self.pool.take_events())
        return ServedRequest(cached, computed, host, cached - device - host)

    def _tier_hits(self, hash_ids: Sequence[int]) -> list[str]:
        """Which tier holds each leading block past the pool's prefix ("host" or "shared"), to the first miss."""
        found: list[str] = []
        for block_hash in hash_ids:
            if self.host is not None and block_hash in self.host:
                found.append("host")
            elif self.shared.hit(block_hash):
                found.append("shared")
            else:
                break
        return found

    def _move_host_blocks(
        self, new_hashes: Sequence[int], new_blocks: Sequence[int], tiers: Sequence[str]
    ) -> None:
        """Promote the host tier's hits into their new pool blocks, then demote what the pool evicted
        for them, as the engine's KV cache manager orders it; the copy orders have nothing to copy."""
        evicted = self.pool.take_evicted()
        if self.host is None:
            return
        promoted = [i for i, tier in enumerate(tiers) if tier == "host"]
        self.host.promote([new_hashes[i] for i in promoted], [new_blocks[i] for i in promoted])
        self.host.demote(evicted)
        self.host.take_moves()

    def _retain(self, hash_ids: Sequence[int], until: float) -> None:
        """Put these blocks under retention until ``until`` (trace seconds), in the pool (found by
        hash, as the engine finds them) and in the shared tier, tail first as they are freed."""
        blocks = [block_id for h in hash_ids if (block_id := self.pool.lookup(h)) is not None]
        self.pool.retain(reversed(blocks), until)
        self.shared.retain(hash_ids, until)
        self.block_retentions += len(blocks)

    def _end_retention(self, now: float) -> None:
        self.pool.end_retention(now)
        if self.host is not None:
            self.host.end_retention(now)
        self.shared.end_retention(now)

    def take_events(self) -> list[KvEvent]:
        """The pool's stored/removed events since the last call: what the replica publishes."""
        events, self._events = self._events, []
        return events

    def _leading_hits(self, hash_ids: Sequence[int]) -> list[int]:
        """Block ids of the longest cached prefix; a gap ends it (a child's KV needs its parent's)."""
        hits: list[int] = []
        for block_hash in hash_ids:
            block_id = self.pool.lookup(block_hash)
            if block_id is None:
                break
            hits.append(block_id)
        return hits
