"""Opening a PostgreSQL store: versioned migrations applied once however many processes start
together, a database from a newer build refused, a lost server an UNAVAILABLE that heals."""

from __future__ import annotations

import asyncio
import uuid

import asyncpg
import pytest

from cachet.durable_postgres import StoreNotOpened, migrate, open_pool
from cachet.errors import Unavailable
from cachet.router.postgres_queue_store import PostgresQueueStore

MIGRATIONS = [
    (1, "CREATE TABLE things (id INTEGER PRIMARY KEY)"),
    (2, "ALTER TABLE things ADD COLUMN name TEXT NOT NULL DEFAULT ''"),
]


async def test_migrations_apply_once_when_processes_start_together(postgres_url: str) -> None:
    connections = [await asyncpg.connect(postgres_url) for _ in range(4)]
    try:
        versions = await asyncio.gather(*(migrate(c, MIGRATIONS, store="things") for c in connections))
        assert versions == [2, 2, 2, 2]
        applied = await connections[0].fetch("SELECT store, version FROM schema_migrations ORDER BY version")
        assert [tuple(row) for row in applied] == [("things", 1), ("things", 2)]
        await connections[0].execute("INSERT INTO things (id, name) VALUES (1, 'x')")
        # A later build adds a version: only that one runs, on the data already there.
        later = [*MIGRATIONS, (3, "UPDATE things SET name = name || '3'")]
        assert await migrate(connections[1], later, store="things") == 3
        assert await migrate(connections[2], later, store="things") == 3
        assert await connections[0].fetchval("SELECT name FROM things WHERE id = 1") == "x3"
    finally:
        for connection in connections:
            await connection.close()


async def test_a_database_from_a_newer_build_is_refused(postgres_url: str) -> None:
    pool = await open_pool(postgres_url, [*MIGRATIONS, (3, "SELECT 1")], store="things")
    await pool.close()
    with pytest.raises(
        StoreNotOpened, match="things store in this database has schema version 3; this build knows 2"
    ):
        await open_pool(postgres_url, MIGRATIONS, store="things")


async def test_a_lost_connection_reads_as_unavailable_and_the_store_heals(postgres_url: str) -> None:
    # A name of its own, so that only this store's connections are cut (the server is shared).
    name = f"cachet_test_{uuid.uuid4().hex[:12]}"
    store = await PostgresQueueStore.open(f"{postgres_url}&application_name={name}")
    try:
        batch = await store.create_batch("acct-a", "m", [b"one"])
        # What a failover or an operator's pg_terminate_backend does to every pooled connection.
        admin = await asyncpg.connect(postgres_url)
        try:
            cut = await admin.fetchval(
                "SELECT COUNT(pg_terminate_backend(pid)) FROM pg_stat_activity WHERE application_name = $1",
                name,
            )
        finally:
            await admin.close()
        assert cut >= 1
        # The pool may notice the cut first and reconnect unseen; if the call meets it, the
        # caller hears UNAVAILABLE (retry later), never an internal error.
        try:
            job = await store.lease("router-1", lease_seconds=10)
        except Unavailable as unavailable:
            assert "queue store (PostgreSQL) is unreachable" in str(unavailable)
            job = None
        # Either way the pool replaced the dead connections: the next call works, nothing was lost.
        job = job or await store.lease("router-1", lease_seconds=10)
        assert job is not None and job.batch_id == batch
    finally:
        await store.close()
