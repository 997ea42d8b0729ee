"""Jobs and their leases: handing runnable jobs out, keeping or giving them back, storing results.

- ``lease`` hands out one runnable job (queued, or leased by someone whose lease
  expired) to one owner until ``lease_seconds`` from now; a dispatcher that dies simply
  stops renewing, and its jobs become runnable again when their leases lapse: execution
  is *at least once*. Fairness lives here: the next account with work after the one
  served last (round-robin by account id), and within an account the oldest job first.
- ``complete`` writes a job's result with ``UPDATE ... WHERE state != 'done'``: of every
  attempt that finishes, only the first is stored (*exactly once*), and only that call
  sees the batch finish. Completions share commits (``CompletionGroups``).
- ``release`` puts a leased job back (no capacity now) without counting an attempt.

SQLite gets its guarantees from one writer (``BEGIN IMMEDIATE``); PostgreSQL from row
locks (``FOR UPDATE SKIP LOCKED`` for leases, the batch's row for completions). Renewal,
release and counting run the same statements on both.
"""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import Callable, Sequence

import asyncpg

from cachet.durable_postgres import PostgresPool, connection_lost, rows_affected
from cachet.durable_sqlite import SqliteWorker, for_sqlite
from cachet.router.completion_groups import CompletionGroups, PendingCompletion
from cachet.router.queue_batches import postgres_finish_if_ended, sqlite_finish_if_ended
from cachet.router.queue_records import Completion, Job

_RENEW = (
    "UPDATE jobs SET lease_expires_at_ms = $1"
    " WHERE request_id = $2 AND state = 'leased' AND lease_owner = $3 AND attempts = $4"
)
_RELEASE = (
    "UPDATE jobs SET state = 'queued', lease_owner = '', lease_expires_at_ms = 0, attempts = attempts - 1"
    " WHERE request_id = $1 AND state = 'leased' AND lease_owner = $2 AND attempts = $3"
)
_COMPLETE = (
    "UPDATE jobs SET state = 'done', result = $1, finished_at_ms = $2, lease_owner = ''"
    " WHERE request_id = $3 AND state != 'done'"
)
# Walks the (state, ...) index, not the table: a few ms at 100,000 jobs.
_COUNTS = "SELECT state, COUNT(*) FROM jobs GROUP BY state"

# SQLite's lease asks its two questions once per kind of runnable job rather than over
# "queued, or leased and lapsed": an OR across states makes SQLite collect and sort every
# runnable row, so a lease cost grew with the backlog (34 ms at 100,000 queued jobs). Split,
# each query starts at its first entry of the (state, account_id, seq) index; the lapsed
# branch walks only leased rows, which are as many as the jobs in flight.
_FIRST_ACCOUNT = """
SELECT MIN(account_id) FROM (
    SELECT MIN(account_id) AS account_id FROM jobs WHERE state = 'queued' AND account_id {bound}
    UNION ALL
    SELECT MIN(account_id) FROM jobs
    WHERE state = 'leased' AND lease_expires_at_ms <= :now AND account_id {bound}
)"""
_NEXT_ACCOUNT = _FIRST_ACCOUNT.format(bound="> :after")
_ANY_ACCOUNT = _FIRST_ACCOUNT.format(bound=">= ''")  # every text sorts at or after ''
_OLDEST_JOB = (
    "SELECT seq, request_id, batch_id, position, body, attempts FROM jobs"
    " WHERE account_id = :account AND {runnable} ORDER BY seq LIMIT 1"
)
_OLDEST_QUEUED_JOB = _OLDEST_JOB.format(runnable="state = 'queued'")
_OLDEST_LAPSED_JOB = _OLDEST_JOB.format(runnable="state = 'leased' AND lease_expires_at_ms <= :now")

# PostgreSQL leases the oldest runnable job of the first account past $1 in one statement,
# asking each kind of runnable job once for the same reason; SKIP LOCKED passes over a job
# another transaction is leasing. Of the two rows found (both locked until commit), the
# older account's, then the older job, is leased.
_LEASE = """
WITH queued AS (
    SELECT request_id, account_id, seq FROM jobs
    WHERE state = 'queued' AND account_id {bound} $1
    ORDER BY account_id, seq LIMIT 1 FOR UPDATE SKIP LOCKED
), lapsed AS (
    SELECT request_id, account_id, seq FROM jobs
    WHERE state = 'leased' AND lease_expires_at_ms <= $2 AND account_id {bound} $1
    ORDER BY account_id, seq LIMIT 1 FOR UPDATE SKIP LOCKED
), chosen AS (
    SELECT request_id FROM (SELECT * FROM queued UNION ALL SELECT * FROM lapsed) AS candidates
    ORDER BY account_id, seq LIMIT 1
)
UPDATE jobs SET state = 'leased', lease_owner = $3, lease_expires_at_ms = $4, attempts = jobs.attempts + 1
FROM chosen WHERE jobs.request_id = chosen.request_id
RETURNING jobs.request_id, jobs.batch_id, jobs.position, jobs.account_id, jobs.body, jobs.attempts"""
_LEASE_NEXT = _LEASE.format(bound=">")
_LEASE_ANY = _LEASE.format(bound=">=")  # with $1 = '': every text sorts at or after ''

# A group's results in one statement; a job named twice is updated once.
_COMPLETE_ALL = """
UPDATE jobs SET state = 'done', result = completions.result, finished_at_ms = $3, lease_owner = ''
FROM unnest($1::text[], $2::bytea[]) AS completions (request_id, result)
WHERE jobs.request_id = completions.request_id AND jobs.state != 'done'
RETURNING jobs.request_id, jobs.batch_id"""
# The group's batches with no job left to end, finished (webhook armed) by this statement.
_FINISH_ENDED = """
UPDATE batches SET finished_at_ms = $2,
    webhook_state = CASE WHEN webhook_url = '' THEN '' ELSE 'pending' END, webhook_due_at_ms = $2
WHERE batch_id = ANY($1::text[]) AND finished_at_ms IS NULL
AND NOT EXISTS (SELECT 1 FROM jobs WHERE jobs.batch_id = batches.batch_id AND state IN ('queued', 'leased'))
RETURNING batch_id"""


class SqliteLeases:
    """The SQLite store's jobs; ``SqliteQueueStore`` supplies the worker, the clock and the completion groups."""

    _worker: SqliteWorker
    _clock_ms: Callable[[], int]
    _completions: CompletionGroups

    async def lease(self, owner: str, lease_seconds: float, after_account: str = "") -> Job | None:
        """Lease the next runnable job, round-robin by account after ``after_account``; None if idle."""
        jobs = await self.lease_many(owner, lease_seconds, after_account, limit=1)
        return jobs[0] if jobs else None

    async def lease_many(
        self, owner: str, lease_seconds: float, after_account: str = "", *, limit: int
    ) -> list[Job]:
        """Up to ``limit`` jobs in one transaction, in the order ``limit`` calls of ``lease`` would
        take them (each after the previous one's account); fewer when the queue runs dry.

        One commit (one fsync) for all: a dispatcher with several free slots at once had waited
        for a commit per slot, on the worker thread its completions and renewals also need.
        """

        def lease_in(db: sqlite3.Connection) -> list[Job]:
            jobs: list[Job] = []
            after = after_account
            while len(jobs) < limit and (job := self._lease(db, owner, lease_seconds, after)) is not None:
                jobs.append(job)
                after = job.account_id
            return jobs

        return await self._worker.write(lease_in)

    def _lease(self, db: sqlite3.Connection, owner: str, lease_seconds: float, after: str) -> Job | None:
        now = self._clock_ms()
        # The first account after the last one served, wrapping around to the smallest.
        account = db.execute(_NEXT_ACCOUNT, {"now": now, "after": after}).fetchone()[0]
        if account is None:
            account = db.execute(_ANY_ACCOUNT, {"now": now}).fetchone()[0]
        if account is None:
            return None
        arguments = {"now": now, "account": account}
        candidates = [
            row
            for query in (_OLDEST_QUEUED_JOB, _OLDEST_LAPSED_JOB)
            if (row := db.execute(query, arguments).fetchone()) is not None
        ]
        _, request_id, batch_id, position, body, attempts = min(candidates)
        db.execute(
            "UPDATE jobs SET state = 'leased', lease_owner = ?, lease_expires_at_ms = ?, attempts = ?"
            " WHERE request_id = ?",
            (owner, now + int(lease_seconds * 1000), attempts + 1, request_id),
        )
        return Job(request_id, batch_id, position, account, body, owner, attempts + 1)

    async def renew(self, job: Job, lease_seconds: float) -> bool:
        """Extend a lease we still hold; False when it was lost (expired and taken, or finished)."""

        def renew(db: sqlite3.Connection) -> bool:
            expires = self._clock_ms() + int(lease_seconds * 1000)
            return (
                db.execute(for_sqlite(_RENEW), (expires, job.request_id, job.owner, job.attempt)).rowcount
                == 1
            )

        return await self._worker.run(renew)

    async def release(self, job: Job) -> bool:
        """Give a leased job back to the queue (no capacity now); the attempt does not count."""
        return await self._worker.run(
            lambda db: (
                db.execute(for_sqlite(_RELEASE), (job.request_id, job.owner, job.attempt)).rowcount == 1
            )
        )

    async def complete(self, job: Job, result: bytes) -> Completion:
        """Store ``result`` unless another attempt already did; finish the batch with its last job.

        Any attempt may complete, even one whose lease lapsed: its work is as good as
        the retry's, and the conditional update keeps whichever came first.
        """
        return await self._completions.complete(job, result)

    async def _write_completions(self, group: Sequence[PendingCompletion]) -> list[Completion | Exception]:
        return await self._worker.write(lambda db: self._complete_all(db, group))

    def _complete_all(
        self, db: sqlite3.Connection, group: Sequence[PendingCompletion]
    ) -> list[Completion | Exception]:
        outcomes: list[Completion | Exception] = []
        for pending in group:
            db.execute("SAVEPOINT completion")
            try:
                outcomes.append(self._complete(db, pending.job, pending.result))
            except sqlite3.Error as error:
                db.execute("ROLLBACK TO completion")
                outcomes.append(error)
            db.execute("RELEASE completion")
        return outcomes

    def _complete(self, db: sqlite3.Connection, job: Job, result: bytes) -> Completion:
        now = self._clock_ms()
        if not db.execute(for_sqlite(_COMPLETE), (result, now, job.request_id)).rowcount:
            return Completion(stored=False, batch_finished=False)
        return Completion(stored=True, batch_finished=sqlite_finish_if_ended(db, job.batch_id, now))

    async def counts(self) -> dict[str, int]:
        """Jobs per state (for logs and tests)."""
        return await self._worker.run(_count_states)

    def counts_off_the_loop(self, timeout: float) -> dict[str, int]:
        """``counts`` for a thread that is not the event loop's (a metrics scrape)."""
        return self._worker.run_blocking(_count_states, timeout)


def _count_states(db: sqlite3.Connection) -> dict[str, int]:
    return dict(db.execute(_COUNTS).fetchall())


class PostgresLeases:
    """The PostgreSQL store's jobs; ``PostgresQueueStore`` supplies the pool, the clock, the event
    loop and the completion groups."""

    _pool: PostgresPool
    _clock_ms: Callable[[], int]
    _loop: asyncio.AbstractEventLoop
    _completions: CompletionGroups

    async def lease(self, owner: str, lease_seconds: float, after_account: str = "") -> Job | None:
        """Lease the next runnable job, round-robin by account after ``after_account``; None if idle."""
        jobs = await self.lease_many(owner, lease_seconds, after_account, limit=1)
        return jobs[0] if jobs else None

    async def lease_many(
        self, owner: str, lease_seconds: float, after_account: str = "", *, limit: int
    ) -> list[Job]:
        """Up to ``limit`` jobs in one transaction, in the order ``limit`` calls of ``lease`` would take them."""
        jobs: list[Job] = []
        async with self._pool.transaction() as db:
            after = after_account
            while (
                len(jobs) < limit and (job := await self._lease(db, owner, lease_seconds, after)) is not None
            ):
                jobs.append(job)
                after = job.account_id
        return jobs

    async def _lease(
        self, db: asyncpg.Connection, owner: str, lease_seconds: float, after: str
    ) -> Job | None:
        now = self._clock_ms()
        expires = now + int(lease_seconds * 1000)
        # The first account after the last one served, wrapping around to the smallest.
        row = await db.fetchrow(_LEASE_NEXT, after, now, owner, expires) or await db.fetchrow(
            _LEASE_ANY, "", now, owner, expires
        )
        if row is None:
            return None
        request_id, batch_id, position, account_id, body, attempts = row
        return Job(request_id, batch_id, position, account_id, body, owner, attempts)

    async def renew(self, job: Job, lease_seconds: float) -> bool:
        """Extend a lease we still hold; False when it was lost (expired and taken, or finished)."""
        expires = self._clock_ms() + int(lease_seconds * 1000)
        async with self._pool.connection() as db:
            status = await db.execute(_RENEW, expires, job.request_id, job.owner, job.attempt)
        return rows_affected(status) == 1

    async def release(self, job: Job) -> bool:
        """Give a leased job back to the queue (no capacity now); the attempt does not count."""
        async with self._pool.connection() as db:
            status = await db.execute(_RELEASE, job.request_id, job.owner, job.attempt)
        return rows_affected(status) == 1

    async def complete(self, job: Job, result: bytes) -> Completion:
        """Store ``result`` unless another attempt already did; finish the batch with its last job.

        Completions share commits (``CompletionGroups``), each in a savepoint of its own.
        """
        return await self._completions.complete(job, result)

    async def _write_completions(self, group: Sequence[PendingCompletion]) -> list[Completion | Exception]:
        async with self._pool.transaction() as db:
            # Every batch of the group locked up front, in id order: two routers' groups that
            # share batches then queue behind each other instead of deadlocking.
            await db.execute(
                "SELECT 1 FROM batches WHERE batch_id = ANY($1::text[]) ORDER BY batch_id FOR UPDATE",
                sorted({pending.job.batch_id for pending in group}),
            )
            try:
                async with db.transaction():
                    return await self._complete_together(db, group)
            except asyncpg.PostgresError as error:
                if connection_lost(error):
                    raise
                # One of them cannot be written: each in a savepoint of its own, so it fails alone.
            outcomes: list[Completion | Exception] = []
            for pending in group:
                try:
                    async with db.transaction():
                        outcomes.append(await self._complete(db, pending.job, pending.result))
                except asyncpg.PostgresError as error:
                    if connection_lost(error):
                        raise
                    outcomes.append(error)
            return outcomes

    async def _complete_together(
        self, db: asyncpg.Connection, group: Sequence[PendingCompletion]
    ) -> list[Completion | Exception]:
        """The group in two statements (results, then the batches they ended); one completion
        after another took five round trips each, and held a router's drain below its leases."""
        now = self._clock_ms()
        first: dict[str, int] = {}
        for index, pending in enumerate(group):
            first.setdefault(pending.job.request_id, index)
        rows = await db.fetch(_COMPLETE_ALL, list(first), [group[i].result for i in first.values()], now)
        stored = {first[row["request_id"]] for row in rows}
        ended = {
            row["batch_id"]
            for row in await db.fetch(_FINISH_ENDED, sorted({r["batch_id"] for r in rows}), now)
        }
        # One completion reports its batch's end: the last one of the group stored for it.
        reporter = {group[index].job.batch_id: index for index in sorted(stored)}
        return [
            Completion(
                stored=index in stored,
                batch_finished=index in stored
                and pending.job.batch_id in ended
                and reporter[pending.job.batch_id] == index,
            )
            for index, pending in enumerate(group)
        ]

    async def _complete(self, db: asyncpg.Connection, job: Job, result: bytes) -> Completion:
        now = self._clock_ms()
        if not rows_affected(await db.execute(_COMPLETE, result, now, job.request_id)):
            return Completion(stored=False, batch_finished=False)
        return Completion(stored=True, batch_finished=await postgres_finish_if_ended(db, job.batch_id, now))

    async def counts(self) -> dict[str, int]:
        """Jobs per state (for logs and tests)."""
        async with self._pool.connection() as db:
            rows = await db.fetch(_COUNTS)
        return {state: count for state, count in rows}

    def counts_off_the_loop(self, timeout: float) -> dict[str, int]:
        """``counts`` for a thread that is not the event loop's (a metrics scrape)."""
        return asyncio.run_coroutine_threadsafe(self.counts(), self._loop).result(timeout)
