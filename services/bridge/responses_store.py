"""Stored responses (``store: true``): what ``previous_response_id`` continues and ``GET`` returns.

Kept per account in one SQLite file under the bridge's data directory
(``<data_dir>/responses.sqlite3``, or ``CACHET_BRIDGE_RESPONSES_DATABASE``).
Interim: DESIGN.md wants them in the durable store the async queue uses (SQLite
or PostgreSQL behind the router), which needs a router RPC and a table in both
queue stores; until then a bridge replica keeps its own file, so several bridge
replicas behind one load balancer do not see each other's responses.

A row holds the response as answered and the conversation's input items (every
turn of the chain before this response's output, with ids), so a follow-up is
``input_items + output + its own input`` without walking the chain; and the
session id that placed it, so the follow-up lands on the replica holding its KV.
"""

from __future__ import annotations

import json
import sqlite3
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

Json = dict[str, Any]

_SCHEMA = """
CREATE TABLE IF NOT EXISTS responses (
    account_id  TEXT NOT NULL,
    id          TEXT NOT NULL,
    created_at  INTEGER NOT NULL,
    session_id  TEXT NOT NULL,
    response    TEXT NOT NULL,
    input_items TEXT NOT NULL,
    PRIMARY KEY (account_id, id)
)
"""


@dataclass(frozen=True)
class StoredResponse:
    id: str
    session_id: str
    # The Response object as it was answered (status, output, usage...).
    response: Json
    # The whole conversation before this response's output, oldest first, each with an id.
    input_items: list[Json]

    def conversation(self) -> list[Json]:
        """What a follow-up continues: every input item, then this response's output."""
        return [*self.input_items, *self.response["output"]]


class ResponseStore:
    """One SQLite file, opened on first use; calls are short and serialised by a lock, and the
    routes run them off the event loop."""

    def __init__(self, path: Path) -> None:
        self._path = path
        self._lock = threading.Lock()
        self._db: sqlite3.Connection | None = None

    def put(self, account_id: str, stored: StoredResponse) -> None:
        row = (
            account_id,
            stored.id,
            int(stored.response["created_at"]),
            stored.session_id,
            json.dumps(stored.response, separators=(",", ":")),
            json.dumps(stored.input_items, separators=(",", ":")),
        )
        with self._lock:
            db = self._open()
            db.execute("INSERT OR REPLACE INTO responses VALUES (?, ?, ?, ?, ?, ?)", row)
            db.commit()

    def get(self, account_id: str, response_id: str) -> StoredResponse | None:
        with self._lock:
            row = (
                self._open()
                .execute(
                    "SELECT session_id, response, input_items FROM responses WHERE account_id = ? AND id = ?",
                    (account_id, response_id),
                )
                .fetchone()
            )
        if row is None:
            return None
        return StoredResponse(response_id, row[0], json.loads(row[1]), json.loads(row[2]))

    def delete(self, account_id: str, response_id: str) -> bool:
        with self._lock:
            db = self._open()
            deleted = db.execute(
                "DELETE FROM responses WHERE account_id = ? AND id = ?", (account_id, response_id)
            ).rowcount
            db.commit()
        return deleted > 0

    def close(self) -> None:
        with self._lock:
            if self._db is not None:
                self._db.close()
                self._db = None

    def _open(self) -> sqlite3.Connection:
        # Opened lazily: an app that never stores a response (tests of other routes) leaves no file.
        if self._db is None:
            self._path.parent.mkdir(parents=True, exist_ok=True)
            db = sqlite3.connect(self._path, check_same_thread=False)
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=NORMAL")
            db.execute(_SCHEMA)
            db.commit()
            self._db = db
        return self._db
