"""Per-request block tables on top of the block pool, with automatic prefix caching.

A request's KV lives in the blocks of its block table, token ``t`` in block
``t // block_size``. Blocks are named by the chained prefix hash of
``cachet.block_hash`` (seed = model id + the request's cache salt), so any later
request whose tokens start the same way finds them and shares them: sharing is
a ref-count increment, never a copy.

Ownership contract: a request holds exactly one reference on every block of its
table, from ``allocate_slots`` until ``free``. A block is named (registered in
the pool's hash map) only once it is full *and* its KV has been computed, so a
cache hit never reads KV that a forward pass has not written yet.

Copy-on-write of the block of a new request's last token: past its full hits, that block
(a prompt's partial last block) may be computed, up to that token, by another live request
with the same tokens: choice 0 of the same ``n`` > 1 request, whose first token the router
waits for before it sends the other choices. That block is never a hit (a partial block is
not named, and a named full block cannot take the request's own write of its last token),
so rather than recompute its tokens the request copies it into a fresh block of its own
(``KvBlockMoves.duplicate``) and computes only its last token, whose logits it samples its
first token from. The copied tokens count as pool hits.

With a host tier (``host_kv_tier``), blocks the pool evicts are copied down to it, and
a prefix that continues in the host tier past the pool's hits is copied back into
freshly allocated blocks: those tokens count as cached, like pool hits.

With a shared file tier too (``shared_kv_tier``), every block is written there once it
is named, and a new request's prefix that continues there is loaded into the host tier
before the request is admitted (``start_prefetch``; the request waits, the steps go on).

Retention (``kv_retention``): when a request that carries one leaves the pool, its retained
blocks are kept in preference to others (``BlockPool.retain``); the pool evicts them last, the
host tier takes them in, and the shared tier's clean-up spares their files, until their
retention ends. Cached tokens count the same whichever tier served them.

The KV events (``take_events``) are every tier's: the pool's (``"engine"``), the host
tier's and the shared tier's, each in its own order, so the cache index knows where each
block can still be found, not only whether the pool holds it.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

import structlog

from cachet.block_hash import DEFAULT_BLOCK_SIZE, ImageSpan, chain_hashes, hash_seed
from cachet.engine.block_pool import BlockPool, KvEvent
from cachet.engine.host_kv_tier import HostTierIndex
from cachet.engine.request import Request
from cachet.engine.step_plan import KvBlockMoves
from cachet.engine.tier_events import snapshot

if TYPE_CHECKING:
    from cachet.engine.kv_transfer import ReceivedBlocks
    from cachet.engine.shared_kv_tier import SharedKvFiles

log = structlog.get_logger(__name__)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    """Block tables of live requests; hides the pool from the scheduler."""

    def __init__(
        self,
        pool: BlockPool,
        *,
        model: str,
        block_size: int = DEFAULT_BLOCK_SIZE,
        host_tier: HostTierIndex | None = None,
        shared_tier: SharedKvFiles | None = None,
        received: ReceivedBlocks | None = None,
        block_bytes: int = 0,
        clock: Callable[[], float] = time.time,
        reproducible_kernels: str = "",
    ) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.pool = pool
        self.model = model
        self.block_size = block_size
        # Greedy and seeded requests' KV comes from batch-invariant steps, run by these kernels
        # (ModelRunner.reproducible_kernels; empty: no such steps): named apart.
        self.reproducible_kernels = reproducible_kernels
        self.host_tier = host_tier if pool.enable_caching else None
        if shared_tier is not None and self.host_tier is None:
            raise ValueError("a shared KV tier loads into the host tier: it needs one")
        self.shared_tier = shared_tier if self.host_tier is not None else None
        # Blocks other replicas pushed here (kv_transfer): loaded into the host tier too.
        self.received = received if self.host_tier is not None else None
        # Blocks named since the last plan that the shared tier lacks: (block id, hash).
        self._store: list[tuple[int, int]] = []
        # Blocks named since the last plan that go to another replica: (block id, hash, address),
        # and per hand-off request, how many of its leading blocks are ordered sent.
        self._send: list[tuple[int, int, str]] = []
        self._sent: dict[str, int] = {}
        self._tables: dict[str, list[int]] = {}
        # Leading blocks of each table already named (or found already named elsewhere).
        self._num_named: dict[str, int] = {}
        # Hashes found in the host tier by the last get_computed_blocks, per request, for the
        # allocate_slots call that admits it.
        self._host_hits: dict[str, list[int]] = {}
        # Likewise, the block another request computed that the admitting call copies, and the
        # tokens of it that count as computed.
        self._partial_hits: dict[str, tuple[int, int]] = {}
        # Copy-on-write orders (source block, fresh block of the request that copies it) since
        # the last plan.
        self._duplicate: list[tuple[int, int]] = []
        # Per request, where its prefetch came from (shared, transfer) and the hashes it filled
        # into the host tier: their hits count as that source's.
        self._from_lower: dict[str, tuple[str, set[int]]] = {}
        # Totals since start, for metrics (fixed keys: read from other threads).
        self.hit_tokens = {"engine": 0, "host": 0, "shared": 0, "transfer": 0}
        self.block_copies = {"demote": 0, "promote": 0, "store": 0, "load": 0, "duplicate": 0, "send": 0}
        # Bytes of one block's KV on this rank (0: unknown), which turns copies into bytes moved.
        self.block_bytes = block_bytes
        # Wall-clock seconds, which retention deadlines are in: the shared tier's files carry
        # them, for every replica's clean-up to read.
        self.clock = clock
        # Blocks put under retention (or kept longer) as their requests left the pool, since start.
        self.block_retentions = 0

    # ------------------------------------------------------------------ queries

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_retained_blocks(self) -> dict[str, int]:
        """Blocks under a live retention in the pool and in the host tier."""
        host = self.host_tier.num_retained if self.host_tier is not None else 0
        return {"engine": self.pool.num_retained_blocks, "host": host}

    @property
    def num_host_blocks(self) -> tuple[int, int]:
        """(held, slots) of the host tier; (0, 0) without one."""
        tier = self.host_tier
        return (len(tier), tier.num_slots) if tier is not None else (0, 0)

    def block_ids(self, request_id: str) -> list[int]:
        """A copy of the request's block table (empty when it holds none)."""
        return list(self._tables.get(request_id, ()))

    def cached_block_hashes(self) -> set[int]:
        """Hashes of every block the pool holds, which a new request reuses in place."""
        return self.pool.cached_hashes()

    def snapshot_events(self) -> list[KvEvent]:
        """Every tier's blocks as stored events: what a new KV event follower starts from."""
        events = snapshot("engine", self.pool.cached_hashes())
        if self.host_tier is not None:
            events += self.host_tier.snapshot_events()
        if self.shared_tier is not None:
            events += self.shared_tier.snapshot_events()
        return events

    @property
    def copies_by_direction(self) -> dict[str, int]:
        """Blocks copied by direction since start (demote/promote: host tier, store/load: shared,
        duplicate: within the pool, send: to another replica's receiver); where this replica
        takes hand-offs, also the blocks pushed into its receiver (receive) and those dropped
        there unused past its budget (receive_dropped: a request that wanted one loads it from
        another tier or computes it)."""
        copies = dict(self.block_copies)
        if self.received is not None:
            copies["receive"] = self.received.counts["received"]
            copies["receive_dropped"] = self.received.counts["dropped"]
        return copies

    @property
    def block_copy_bytes(self) -> dict[str, int]:
        """``copies_by_direction`` in bytes (every direction moves whole blocks of this layout)."""
        return {direction: n * self.block_bytes for direction, n in self.copies_by_direction.items()}

    def can_ever_fit(self, num_tokens: int) -> bool:
        """Whether KV for ``num_tokens`` tokens fits in the pool with nothing else in it."""
        return cdiv(num_tokens, self.block_size) <= self.pool.num_blocks

    # --------------------------------------------------------------- allocation

    def get_computed_blocks(self, request: Request, sources: Iterable[Request] = ()) -> tuple[list[int], int]:
        """Leading cached blocks of a request that holds none yet, and the tokens they cover.

        The request's last token is never taken from the cache: the forward pass
        must compute it to produce logits. So at most ``num_tokens - 1`` tokens
        come from the cache, rounded down to a block boundary. Takes no reference.

        The token count includes the blocks that continue the prefix in the host tier, and,
        when those reach the block of the last token, that block's tokens before the last one
        if one of ``sources`` has computed them (live requests whose computed tokens' KV is
        written: none admitted in the plan being built, whose hits may not be copied in yet).
        The ``allocate_slots`` call that admits the request allocates and fills them.
        """
        if not self.pool.enable_caching:
            return [], 0
        self._update_block_hashes(request)
        self._install_prefetch(request)
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[int] = []
        for block_hash in request.block_hashes[:max_blocks]:
            block_id = self.pool.lookup(block_hash)
            if block_id is None:
                break
            hits.append(block_id)
        host_hits: list[int] = []
        if self.host_tier is not None:
            for block_hash in request.block_hashes[len(hits) : max_blocks]:
                if block_hash not in self.host_tier:
                    break
                host_hits.append(block_hash)
        self._host_hits[request.request_id] = host_hits
        num_hit_tokens = (len(hits) + len(host_hits)) * self.block_size
        self._partial_hits.pop(request.request_id, None)
        if len(hits) + len(host_hits) == max_blocks:
            partial = self._computed_elsewhere(request, max_blocks, sources)
            if partial is not None:
                self._partial_hits[request.request_id] = partial
                num_hit_tokens += partial[1]
        return hits, num_hit_tokens

    def _computed_elsewhere(
        self, request: Request, block_index: int, sources: Iterable[Request]
    ) -> tuple[int, int] | None:
        """(block id, tokens) of a source's block ``block_index`` whose KV holds the request's
        tokens there, all but its last token; None when no source has computed them.

        Sharing KV takes what a hit does: the same tokens after the same chain (model, cache
        salt, batch-invariant or not, and every token and image before the block: one hash),
        and the same images among the copied tokens, whose placeholder ids alone cannot tell
        two images apart::

            tokens:  [ ... hits: blocks < block_index ... | start ...... end | last token ]
                                                            copied (< block_size)  computed
        """
        start, end = block_index * self.block_size, request.num_tokens - 1
        if end <= start:
            return None
        chain = self._chain_before(request, block_index)
        tokens = request.all_token_ids[start:end]
        for source in sources:
            table = self._tables.get(source.request_id)
            if table is None or len(table) <= block_index or source.num_computed_tokens < end:
                continue
            self._update_block_hashes(source)
            if (
                self._chain_before(source, block_index) == chain
                and source.all_token_ids[start:end] == tokens
                and _image_spans(source, start, end) == _image_spans(request, start, end)
            ):
                return table[block_index], end - start
        return None

    def _chain_before(self, request: Request, block_index: int) -> int:
        """The hash naming every token before block ``block_index`` (its chain's seed for 0)."""
        return request.block_hashes[block_index - 1] if block_index else self._hash_seed(request)

    def allocate_slots(
        self, request: Request, num_new_tokens: int, new_computed_blocks: Sequence[int] = ()
    ) -> list[int] | None:
        """Make room for ``num_new_tokens`` more tokens; return the newly allocated block ids.

        ``new_computed_blocks`` (from ``get_computed_blocks``, first call only) join
        the table first and gain one reference each; the host-tier hits that call found
        follow them, in new blocks their KV is copied into. Returns None, changing
        nothing, when the pool cannot supply the blocks: the caller preempts or waits.
        """
        table = self._tables.get(request.request_id, [])
        if new_computed_blocks and table:
            raise AssertionError(f"{request.request_id}: cache hits after blocks were allocated")
        self._end_retention()
        host_hits = self._host_hits.pop(request.request_id, []) if not table else []
        partial = self._partial_hits.pop(request.request_id, None) if not table else None
        num_copied = partial[1] if partial is not None else 0
        num_computed = (
            request.num_computed_tokens
            + (len(new_computed_blocks) + len(host_hits)) * self.block_size
            + num_copied
        )
        num_needed = (
            cdiv(num_computed + num_new_tokens, self.block_size) - len(table) - len(new_computed_blocks)
        )
        # Hits on free cached blocks take them off the free list: they are not
        # available for the fresh allocation below.
        num_revived = sum(1 for b in new_computed_blocks if self.pool.ref_count(b) == 0)
        if max(num_needed, 0) > self.pool.num_free_blocks - num_revived:
            return None
        # Touch before allocating: the hits must leave the free list before
        # allocate() can evict them from its head.
        self.pool.touch(new_computed_blocks)
        new_blocks = self.pool.allocate(max(num_needed, 0))
        evicted = self.pool.take_evicted()
        if self.host_tier is not None:
            # Promote first: it locks the hits' slots, so the demotions of the blocks this
            # allocation evicted cannot take those slots before the runner has read them.
            self.host_tier.promote(host_hits, new_blocks[: len(host_hits)])
            self.host_tier.demote(evicted)
        if partial is not None:
            # The block after the host hits: the one the request writes its last token into.
            self._duplicate.append((partial[0], new_blocks[len(host_hits)]))
        self.hit_tokens["engine"] += len(new_computed_blocks) * self.block_size + num_copied
        source, loaded = self._from_lower.pop(request.request_id, ("shared", set()))
        from_lower = sum(1 for h in host_hits if h in loaded)
        self.hit_tokens["host"] += (len(host_hits) - from_lower) * self.block_size
        self.hit_tokens[source] += from_lower * self.block_size
        if request.request_id not in self._tables:
            self._num_named[request.request_id] = len(new_computed_blocks)
        self._tables[request.request_id] = table + list(new_computed_blocks) + new_blocks
        return new_blocks

    def cache_computed_blocks(self, request: Request) -> None:
        """Name every block that is now full and computed (call after num_computed_tokens advances)."""
        table = self._tables.get(request.request_id)
        if table is None or not self.pool.enable_caching:
            return
        start = self._num_named[request.request_id]
        end = min(request.num_computed_tokens // self.block_size, len(table))
        if end <= start:
            return
        self._update_block_hashes(request)
        parent = request.block_hashes[start - 1] if start else None
        self.pool.cache_blocks(table[start:end], request.block_hashes[start:end], parent)
        self._num_named[request.request_id] = end
        if self.shared_tier is not None:
            self._store.extend(
                (block_id, block_hash)
                for block_id, block_hash in zip(
                    table[start:end], request.block_hashes[start:end], strict=True
                )
                if not self.shared_tier.contains(block_hash)
            )
        if request.hand_off_kv:
            request.timeline.kv_handed_off_blocks = end
            request.timeline.kv_handed_off_bytes = end * self.block_bytes
        if request.hand_off_to:
            # Every full block of a hand-off's prompt goes, those found cached here too: the
            # decode replica takes the run after what it holds itself.
            first = self._sent.get(request.request_id, 0)
            self._send.extend(
                (block_id, block_hash, request.hand_off_to)
                for block_id, block_hash in zip(
                    table[first:end], request.block_hashes[first:end], strict=True
                )
            )
            self._sent[request.request_id] = end

    def free(self, request: Request) -> None:
        """Drop the request's references, tail block first, so its tail is evicted first; its
        retained blocks are put under retention first (``_retain``)."""
        self._retain(request)
        table = self._tables.pop(request.request_id, [])
        self._num_named.pop(request.request_id, None)
        self._host_hits.pop(request.request_id, None)
        self._partial_hits.pop(request.request_id, None)
        self._from_lower.pop(request.request_id, None)
        self._sent.pop(request.request_id, None)
        # A request freed in the step that admitted it (preempted for a seat, aborted) drops its
        # copy: the block it was to fill may go to another request in that same step.
        freed = set(table)
        self._duplicate = [(src, dst) for src, dst in self._duplicate if dst not in freed]
        self.pool.free(reversed(table))

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix, the host tier's too (only when no request holds blocks);
        True when done."""
        if not self.pool.reset():
            return False
        if self.host_tier is not None:
            self.host_tier.clear()
        return True

    @property
    def has_pending_moves(self) -> bool:
        """Blocks named since the last plan wait to be written to the shared tier or sent."""
        return bool(self._store or self._send)

    @property
    def has_pending_events(self) -> bool:
        """The shared tier's worker wrote or dropped files since the last ``take_events``: events a
        step with nothing else to do must still publish."""
        return self.shared_tier is not None and self.shared_tier.has_events

    def take_block_moves(self) -> KvBlockMoves:
        """Block copies ordered since the last call, for the plan: within the pool, and between
        the pool and the lower tiers."""
        duplicate, self._duplicate = self._duplicate, []
        send, self._send = self._send, []
        self.block_copies["duplicate"] += len(duplicate)
        self.block_copies["send"] += len(send)
        if self.host_tier is None:
            return KvBlockMoves(duplicate=duplicate, send=send)
        moves = dataclasses.replace(self.host_tier.take_moves(self._store), duplicate=duplicate, send=send)
        self._store = []
        self.block_copies["demote"] += len(moves.demote)
        self.block_copies["promote"] += len(moves.promote)
        self.block_copies["store"] += len(moves.store)
        self.block_copies["load"] += len(moves.fill)
        return moves

    def start_prefetch(self, request: Request) -> Future[list[tuple[int, Any]]] | None:
        """Start loading the part of a new request's prefix that only a lower source holds: the
        run of blocks after those the pool and the host tier hold, from what a prefill replica
        pushed here, else from the shared tier. The request is not ready (``Request.is_ready``)
        until the load is done; None when there is none to load."""
        if self.host_tier is None or (self.shared_tier is None and self.received is None):
            return None
        self._update_block_hashes(request)
        max_blocks = (request.num_tokens - 1) // self.block_size
        hashes = request.block_hashes[:max_blocks]
        first = 0
        while first < len(hashes) and (
            self.pool.lookup(hashes[first]) is not None or hashes[first] in self.host_tier
        ):
            first += 1
        pushed = self.received.take_run(hashes[first:]) if self.received is not None else []
        if pushed:
            request.kv_prefetch = Future()
            request.kv_prefetch_source = "transfer"
            request.kv_prefetch.set_result(pushed)
        else:
            shared = self.shared_tier
            if shared is None:
                return None
            run = []
            for block_hash in hashes[first:]:
                if not shared.contains(block_hash):
                    break
                run.append(block_hash)
            if not run:
                return None
            request.kv_prefetch = shared.read_later(run)
        timeline = request.timeline

        def stamp(loaded: Future[list[tuple[int, Any]]]) -> None:
            timeline.kv_loaded_ns = time.time_ns()
            timeline.kv_loaded_blocks = 0 if loaded.exception() else len(loaded.result())

        request.kv_prefetch.add_done_callback(stamp)
        return request.kv_prefetch

    def _install_prefetch(self, request: Request) -> None:
        """Blocks a finished prefetch loaded go into the host tier (filled before this step's
        promotions), where the lookup that follows finds them."""
        prefetch, request.kv_prefetch = request.kv_prefetch, None
        if prefetch is None or self.host_tier is None:
            return
        try:
            loaded = prefetch.result()
        except Exception as exc:  # a load that failed costs a recompute, never the request
            log.warning("shared KV prefetch failed", request_id=request.request_id, error=str(exc))
            return
        self.host_tier.fill(loaded)
        self._from_lower[request.request_id] = (request.kv_prefetch_source, {h for h, _ in loaded})

    def take_events(self) -> list[KvEvent]:
        """KV events since the last call, the pool's, then the host tier's, then the shared tier's,
        each tier's oldest first (the engine publishes them). Tiers are mirrored apart, so only the
        order within a tier matters."""
        events = self.pool.take_events()
        if self.host_tier is not None:
            events += self.host_tier.take_events()
        if self.shared_tier is not None:
            events += self.shared_tier.take_events()
        return events

    def _retain(self, request: Request) -> None:
        """Put the full, computed blocks of the request's retention spans under retention from
        now. A block of its prefix named by another request (the same prefix computed at once)
        is found by its hash: retention belongs to the prefix, not to one table."""
        if not request.retention or not self.pool.enable_caching:
            return
        num_full = min(len(request.block_hashes), request.num_computed_tokens // self.block_size)
        now = self.clock()
        # Spans cover leading blocks: the longest retention takes its blocks, each shorter one
        # the blocks past those a longer one reached.
        spans = sorted(
            ((span.seconds, span.num_blocks(num_full, self.block_size)) for span in request.retention),
            reverse=True,
        )
        start = 0
        for seconds, end in spans:
            if end <= start:
                continue
            hashes = request.block_hashes[start:end]
            blocks = [b for h in hashes if (b := self.pool.lookup(h)) is not None]
            # Tail first, as the blocks are freed: among equal deadlines the tail goes first.
            self.pool.retain(reversed(blocks), now + seconds)
            self.block_retentions += len(blocks)
            if self.shared_tier is not None:
                self.shared_tier.retain(hashes, now + seconds)
            start = end

    def _end_retention(self) -> None:
        now = self.clock()
        self.pool.end_retention(now)
        if self.host_tier is not None:
            self.host_tier.end_retention(now)

    def _update_block_hashes(self, request: Request) -> None:
        """Extend ``request.block_hashes`` to cover every full block of its tokens.

        Computed here even where the router hashed the same prompt for placement, never taken
        from the request: a hash names KV, so one the caller chose would serve it whatever
        prompt (or tenant's salt) owns the block, and the only check is to recompute it. The
        router's may differ anyway (it guesses a request left to the model's default temperature
        as sampled), and it hashes only with several replicas. Cost: 0.5 ms per 8,192-token prompt (docs/ARCHITECTURE.md,
        "The prefix block hash")."""
        num_full = request.num_tokens // self.block_size
        if len(request.block_hashes) >= num_full:
            return
        request.block_hashes += chain_hashes(
            self._hash_seed(request),
            request.block_hashes[-1] if request.block_hashes else 0,
            request.all_token_ids,
            block_size=self.block_size,
            first_block=len(request.block_hashes),
            images=[image.span for image in request.images],
        )

    def _hash_seed(self, request: Request) -> int:
        reproducible = self.reproducible_kernels if request.sampling.reproducible else ""
        return hash_seed(self.model, request.cache_salt, reproducible=reproducible)

    # -------------------------------------------------------------- invariants

    def check_invariants(self, requests: Iterable[Request] = ()) -> None:
        """Pool and host tier invariants, ref count == number of tables holding the block, and per
        request that its table covers its computed tokens and its named blocks carry its hashes."""
        self.pool.check_invariants()
        if self.host_tier is not None:
            self.host_tier.check_invariants()
        holders = [0] * self.pool.num_blocks
        for request_id, table in self._tables.items():
            assert len(set(table)) == len(table), f"{request_id} holds a block twice: {table}"
            for block_id in table:
                holders[block_id] += 1
        for block_id, count in enumerate(holders):
            ref = self.pool.ref_count(block_id)
            assert ref == count, f"block {block_id} has ref count {ref} but {count} tables hold it"
        for request in requests:
            self._check_request(request)
        for source, destination in self._duplicate:
            assert holders[destination], f"copy of block {source} into {destination}, which no request holds"

    def _check_request(self, request: Request) -> None:
        table = self._tables.get(request.request_id, [])
        rid = request.request_id
        assert len(table) * self.block_size >= request.num_computed_tokens, (
            f"{rid}: {len(table)} blocks cannot hold {request.num_computed_tokens} computed tokens"
        )
        for i, block_id in enumerate(table[: self._num_named.get(rid, 0)]):
            block_hash = self.pool.block_hash(block_id)
            assert block_hash in (None, request.block_hashes[i]), (
                f"{rid}: block {block_id} at position {i} carries a foreign hash"
            )


def _image_spans(request: Request, start: int, end: int) -> list[ImageSpan]:
    """The spans of the request's images that hold any of its tokens ``[start, end)``."""
    return [image.span for image in request.images if image.token_offset < end and image.end > start]
