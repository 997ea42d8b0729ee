"""Pulls queued jobs into the engines' headroom; interactive traffic keeps priority.

The headroom rule (knobs in ``RouterSettings``, defaults in brackets):

* If **any** available replica reports an interactive request waiting
  (``waiting_interactive_requests > 0``: one its last step could not admit), nothing
  new is dispatched: interactive traffic is already queueing somewhere, so the fleet
  has no slack to lend.
* Otherwise each available replica lends ``limit − running − waiting`` slots (never
  below 0). The limit is the engine's own: batch work starts there only while fewer
  than ``max_batch_running_requests`` run (``CACHET_ENGINE_BATCH_MAX_RUNNING_FRACTION``
  [0.875] of its seats), and the router keeps ``batch_prefetch`` [4] jobs more waiting
  in its queue, so the step that ends a job seats the next one: a job leased only when
  the seat freed spent ~50 ms (lease, placement, the call) before the engine saw it,
  a sixth of a short job's life. An engine that reports no such limit admits batch
  work into any free seat: for it the limit is
  ``max(1, floor(max_running_requests × batch_max_running_fraction [0.75]))`` and
  nothing is prefetched. Running + waiting is the
  report's count less this router's requests it could hold (those in flight when
  it arrived: the rest is other routers'), plus this router's requests in flight
  there now, so a finished job's slot is lent again at once, not at the next
  report; but only while
  ``free_kv_blocks / total_kv_blocks ≥ batch_min_free_kv_fraction [0.2]``.
  Seats left free (an eighth of the engine's) mean an interactive arrival starts at
  once; the KV floor keeps long batch prompts from evicting the prefixes that
  interactive sessions are about to reuse.
* The slots summed over replicas, minus jobs this router has leased but not yet
  placed, is how many jobs may start now (capped by ``batch_max_in_flight`` when
  set), leased together in one store transaction. Placement itself (cache-aware, bounded load) then picks the replica. The
  dispatcher looks again whenever the engine is done with one of its jobs (before its
  usage and result are written), else every
  ``queue_poll_seconds``.

Jobs run with ``PRIORITY_BATCH``, so even inside that headroom the engine schedules
them after interactive requests and preempts them first. A job never fails for lack
of capacity: an engine refusal (RESOURCE_EXHAUSTED) or an outage (UNAVAILABLE) puts
it back in the queue and pauses dispatch briefly. Fairness: each lease takes the
next account with work after the one served last (``QueueStore.lease``).

Each job's engine and ledger request id is the job id, so a retried job is billed
once (the ledger is idempotent by request id) and its result is stored once
(``QueueStore.complete`` is a conditional update). Leases are renewed while a job
runs; a router killed mid-job stops renewing and another (or its restart) takes
the job again when the lease lapses.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from cachet.common.v1 import common_pb2
from cachet.engine.v1 import engine_pb2
from cachet.errors import CachetError, ResourceExhausted, Unavailable
from cachet.logs import get_logger
from cachet.router import metrics
from cachet.router.batch_queue import EXPIRED_RESULT
from cachet.router.caller import AccountDirectory, Caller
from cachet.router.file_batches import COMPLETION_WINDOW_SECONDS
from cachet.router.key_limits import KeyLimiter, RateLimited
from cachet.router.queue_store import Job, QueueStore
from cachet.router.replica_set import ReplicaSet
from cachet.router.request_pipeline import RequestPipeline
from cachet.router.v1 import router_pb2

log = get_logger(__name__)

# After an engine refused a queued job, wait this long before trying the queue again:
# the load reports that said "headroom" were stale, the next ones will not be.
_REFUSAL_PAUSE_SECONDS = 0.5
# How often the dispatcher ends OpenAI batches whose completion window is over.
EXPIRY_SWEEP_SECONDS = 30.0


@dataclass(frozen=True)
class HeadroomPolicy:
    """The thresholds of the headroom rule (module docstring)."""

    max_running_fraction: float = 0.75
    min_free_kv_fraction: float = 0.2
    prefetch: int = 4


def replica_slots(
    report: engine_pb2.LoadReport,
    in_flight: int,
    policy: HeadroomPolicy,
    in_flight_at_report: int | None = None,
) -> int:
    """Queued jobs one replica may take now (0 when it has no headroom).

    ``in_flight`` is this router's requests there now, ``in_flight_at_report`` when the
    report arrived (default: the same). The report counts other routers' requests and at
    most that many of ours; the rest of its load is others', and ours are known exactly.
    Taking the report as a floor instead left a job's slot idle from its end until the
    next report (a fifth of the drain at 200 ms reports and quarter-second jobs).
    """
    if (
        report.total_kv_blocks
        and report.free_kv_blocks < policy.min_free_kv_fraction * report.total_kv_blocks
    ):
        return 0
    reported = report.running_requests + report.waiting_requests
    at_report = in_flight if in_flight_at_report is None else in_flight_at_report
    others = max(0, reported - at_report)
    if report.max_batch_running_requests:
        limit = report.max_batch_running_requests + policy.prefetch
    else:
        limit = max(1, math.floor(report.max_running_requests * policy.max_running_fraction))
    return max(0, limit - others - in_flight)


@dataclass(frozen=True)
class ReplicaView:
    """What the headroom rule reads of one replica."""

    report: engine_pb2.LoadReport
    in_flight: int
    in_flight_at_report: int


def batch_slots(replicas: Sequence[ReplicaView], policy: HeadroomPolicy) -> int:
    """Queued jobs the fleet may take now."""
    if any(replica.report.waiting_interactive_requests for replica in replicas):
        return 0
    return sum(
        replica_slots(replica.report, replica.in_flight, policy, replica.in_flight_at_report)
        for replica in replicas
    )


class Dispatcher:
    """Leases jobs while there is headroom and runs each to a stored result."""

    def __init__(
        self,
        store: QueueStore,
        pipeline: RequestPipeline,
        replicas: ReplicaSet,
        *,
        policy: HeadroomPolicy,
        lease_seconds: float,
        poll_seconds: float,
        max_attempts: int,
        max_in_flight: int = 0,
        on_batch_finished: Callable[[str], None] = lambda batch_id: None,
        completion_window_seconds: float = COMPLETION_WINDOW_SECONDS,
        expiry_sweep_seconds: float = EXPIRY_SWEEP_SECONDS,
    ) -> None:
        self._store = store
        self._pipeline = pipeline
        self._replicas = replicas
        self._policy = policy
        self._lease_seconds = lease_seconds
        self._poll_seconds = poll_seconds
        self._max_attempts = max_attempts
        self._max_in_flight = max_in_flight
        self._on_batch_finished = on_batch_finished
        self._completion_window_ms = int(completion_window_seconds * 1000)
        self._expiry_sweep_seconds = expiry_sweep_seconds
        self._accounts: AccountDirectory | None = None
        self._limits: KeyLimiter | None = None
        self._next_expiry_sweep = 0.0
        # Unique per process: a restarted router must not mistake its old leases for its own.
        self.owner = f"router-{uuid.uuid4().hex[:12]}"
        self._last_account = ""
        self._unplaced = 0  # leased jobs not yet counted in any replica's in_flight
        self._paused_until = 0.0
        # Set when a job's engine work ends: its slot is free now, not at the next poll (a job of
        # a quarter second idled its slot a tenth of the time, waiting on a 50 ms poll).
        self._slot_freed = asyncio.Event()
        self._jobs: set[asyncio.Task[None]] = set()
        self._loop_task: asyncio.Task[None] | None = None

    def use_keys(self, accounts: AccountDirectory, limits: KeyLimiter) -> None:
        """Run each job as the managed key its batch was queued with, under that key's limits."""
        self._accounts = accounts
        self._limits = limits

    def start(self) -> None:
        self._loop_task = asyncio.create_task(self._loop())

    async def stop(self, drain_seconds: float = 0.0) -> None:
        """Stop taking work, let running jobs finish for ``drain_seconds``, then cancel the rest.

        Cancelled jobs give their leases back at once (no wait for expiry).
        """
        if self._loop_task is not None:
            self._loop_task.cancel()
            await asyncio.gather(self._loop_task, return_exceptions=True)
        if self._jobs and drain_seconds > 0:
            await asyncio.wait(set(self._jobs), timeout=drain_seconds)
        jobs = list(self._jobs)
        for task in jobs:
            task.cancel()
        await asyncio.gather(*jobs, return_exceptions=True)

    async def _loop(self) -> None:
        while True:
            try:
                await self._expire_overdue_batches()
                started = await self._start_some()
            except Exception:  # noqa: BLE001 - the only dispatcher of this router must outlive a bad moment
                log.exception("queue dispatch failed")
                started = False
            if not started:
                self._slot_freed.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._slot_freed.wait(), self._poll_seconds)

    async def _expire_overdue_batches(self) -> None:
        now = asyncio.get_running_loop().time()
        if now < self._next_expiry_sweep:
            return
        self._next_expiry_sweep = now + self._expiry_sweep_seconds
        finished = await self._store.expire_file_batches(
            self._completion_window_ms, EXPIRED_RESULT.SerializeToString()
        )
        for batch_id in finished:
            log.info("batch expired", batch_id=batch_id)
            self._on_batch_finished(batch_id)

    def free_slots(self) -> int:
        """How many more jobs may start now under the headroom rule."""
        loop = asyncio.get_running_loop()
        if loop.time() < self._paused_until:
            return 0
        views = [
            ReplicaView(report, replica.in_flight, replica.in_flight_at_report())
            for replica in self._replicas.available()
            if (report := replica.latest_report()) is not None
        ]
        slots = batch_slots(views, self._policy) - self._unplaced
        if self._max_in_flight:
            slots = min(slots, self._max_in_flight - len(self._jobs))
        return slots

    async def _start_some(self) -> bool:
        """Lease what the free slots allow, in one store transaction; True if any job started."""
        slots = self.free_slots()
        if slots <= 0:
            return False
        leasing = time.monotonic()
        jobs = await self._store.lease_many(self.owner, self._lease_seconds, self._last_account, limit=slots)
        leased = time.monotonic()
        if jobs:
            metrics.QUEUE_JOB_STAGE_SECONDS.labels("lease").observe(leased - leasing)
        for job in jobs:
            self._last_account = job.account_id
            self._unplaced += 1
            task = asyncio.create_task(self._run(job, leased))
            self._jobs.add(task)
            task.add_done_callback(self._job_ended)
        return bool(jobs)

    def _job_ended(self, task: asyncio.Task[None]) -> None:
        self._jobs.discard(task)
        self._slot_freed.set()

    async def _run(self, job: Job, leased: float) -> None:
        placed = False

        def mark_placed() -> None:
            nonlocal placed
            if not placed:
                placed = True
                self._unplaced -= 1

        engine_done_at: float | None = None

        def engine_done() -> None:
            # Its seat no longer counts in ``in_flight``: the next job may start while this one's
            # usage and result are written, which take a ledger flush and a store transaction, a
            # tenth or more of a short job's life.
            nonlocal engine_done_at
            engine_done_at = time.monotonic()
            self._slot_freed.set()

        heartbeat = asyncio.create_task(self._renew(job))
        try:
            result = await self._execute(job, leased, mark_placed, engine_done)
            if result is None:
                await self._store.release(job)
                return
            completion = await self._store.complete(job, result.SerializeToString())
            if engine_done_at is not None:
                metrics.QUEUE_JOB_STAGE_SECONDS.labels("record").observe(time.monotonic() - engine_done_at)
            metrics.QUEUE_RESULTS.labels("stored" if completion.stored else "duplicate").inc()
            if not completion.stored:
                log.info("queued job finished twice; first result kept", request_id=job.request_id)
            if completion.batch_finished:
                log.info("queued batch finished", batch_id=job.batch_id)
                self._on_batch_finished(job.batch_id)
        except asyncio.CancelledError:
            # Router stopping: hand the job back now rather than when the lease lapses.
            with contextlib.suppress(Exception):
                await asyncio.shield(self._store.release(job))
            raise
        finally:
            mark_placed()
            heartbeat.cancel()

    async def _execute(
        self, job: Job, leased: float, mark_placed: Callable[[], None], engine_done: Callable[[], None]
    ) -> router_pb2.QueuedResult | None:
        """The job's result, or None to put it back in the queue; ``leased`` is when its lease
        was taken (monotonic), where its ``start`` stage begins."""
        if job.attempt > self._max_attempts:
            return _error("ABORTED", f"gave up after {self._max_attempts} attempts")
        queued = router_pb2.QueuedRequest.FromString(job.body)
        stages = metrics.QUEUE_JOB_STAGE_SECONDS
        try:
            generation = await self._start(job, queued)
            mark_placed()
            metrics.QUEUE_JOBS_STARTED.inc()
            started = time.monotonic()
            stages.labels("start").observe(started - leased)
            completion = await generation.collect()
            stages.labels("generate").observe(time.monotonic() - started)
            engine_done()
            # The ledger before the result: a router killed in between runs the job again,
            # and its record is then a no-op, instead of leaving a result that was never billed.
            if generation.usage_recorded is not None:
                await generation.usage_recorded
            return router_pb2.QueuedResult(completion=completion)
        except RateLimited as refusal:
            # The key's minute, not the engines, is full: a pause of one poll, not the half second
            # a refusal for capacity takes, since other accounts' jobs are waiting behind this one.
            self._paused_until = asyncio.get_running_loop().time() + self._poll_seconds
            metrics.QUEUE_JOBS_REQUEUED.inc()
            log.info("queued job back to the queue", request_id=job.request_id, reason=str(refusal))
            return None
        except (ResourceExhausted, Unavailable) as refusal:
            # Capacity or an outage, never the request's fault: it waits for the next headroom.
            self._paused_until = asyncio.get_running_loop().time() + _REFUSAL_PAUSE_SECONDS
            metrics.QUEUE_JOBS_REQUEUED.inc()
            log.info("queued job back to the queue", request_id=job.request_id, reason=str(refusal))
            return None
        except CachetError as error:
            return _error(error.status.name, error.message)
        except Exception as error:  # noqa: BLE001 - a bug must end this job with an error, not loop on it
            log.exception("queued job failed", request_id=job.request_id)
            return _error("INTERNAL", f"internal error ({type(error).__name__})")

    async def _start(self, job: Job, queued: router_pb2.QueuedRequest):
        if queued.WhichOneof("body") == "chat":
            chat = queued.chat
            chat.request_id = job.request_id
            caller = await self._caller(job, chat.session_id)
            return await self._pipeline.start_chat(chat, caller, common_pb2.PRIORITY_BATCH, stream=False)
        completion = queued.completion
        completion.request_id = job.request_id
        caller = await self._caller(job, completion.session_id)
        return await self._pipeline.start_completion(
            completion, caller, common_pb2.PRIORITY_BATCH, stream=False
        )

    async def _caller(self, job: Job, session_id: str) -> Caller:
        """The job's caller, admitted under its key's limits now that it runs (RateLimited puts it
        back in the queue like any refusal; QuotaExceeded ends it)."""
        if self._accounts is None:
            return Caller(job.account_id, session_id)
        caller = await self._accounts.batch_caller(job.account_id, job.batch_id, session_id)
        if self._limits is not None:
            await self._limits.admit(caller)
        return caller

    async def _renew(self, job: Job) -> None:
        while True:
            await asyncio.sleep(self._lease_seconds / 3)
            try:
                if not await self._store.renew(job, self._lease_seconds):
                    log.warning("lease of a running queued job was lost", request_id=job.request_id)
                    return
            except Exception:  # noqa: BLE001 - a failed renewal is retried at the next beat
                log.exception("lease renewal failed", request_id=job.request_id)


def _error(code: str, message: str) -> router_pb2.QueuedResult:
    return router_pb2.QueuedResult(error=router_pb2.RequestError(code=code, message=message))
