"""The SQLite files that hold what a user would miss after a restart (usage ledger, queue).

Both want the same guarantees, so they open their files the same way: autocommit
(multi-statement writes open their own BEGIN IMMEDIATE), WAL, FULL fsync so an
acknowledged write survives a power cut and not only a crash, a busy timeout
for a second process holding the write lock a moment, and a schema version
checked on every open.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path


def open_durable_sqlite(
    path: Path, schema: str, schema_version: int, *, what: str, check_same_thread: bool = True
) -> sqlite3.Connection:
    """Open (creating if needed) ``path`` with ``schema``; RuntimeError on another schema version."""
    path.parent.mkdir(parents=True, exist_ok=True)
    connection = sqlite3.connect(path, isolation_level=None, check_same_thread=check_same_thread)
    connection.execute("PRAGMA journal_mode=WAL")
    connection.execute("PRAGMA synchronous=FULL")
    connection.execute("PRAGMA busy_timeout=10000")
    connection.executescript(schema)
    version = connection.execute("PRAGMA user_version").fetchone()[0]
    if version == 0:
        connection.execute(f"PRAGMA user_version={schema_version}")
    elif version != schema_version:
        connection.close()
        raise RuntimeError(f"{path} has {what} schema version {version}; this build knows {schema_version}")
    return connection
