"""A prefix-reuse trace: one request per JSON line, in the Mooncake trace format.

Each line is an object with ``timestamp`` (ms from the trace's start),
``input_length`` and ``output_length`` (tokens), ``hash_ids`` (one id per
``block_tokens``-token block of the prompt, the last block possibly partial;
equal ids at equal positions mean equal prefixes up to and including that block)
and, optionally, ``session_id`` (what a client would send as ``x-session-affinity``) and
``retention_seconds`` (how long the request asked its prompt's KV to be kept, as the router
hands the engine a whole-prompt retention: 600 for OpenAI's ``in_memory``, 86400 for ``24h``;
0 asks for none; absent, a request with a session id gets the operator's session default).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from cachet.engine.kv_retention import MAX_RETENTION_SECONDS


@dataclass(frozen=True)
class TraceRequest:
    """One request of a trace."""

    timestamp_ms: int
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]
    session_id: str = ""
    # Seconds the request asked its KV to be retained (0: none); None: the session default, if any.
    retention_seconds: float | None = None

    def __post_init__(self) -> None:
        if self.retention_seconds is not None and not 0 <= self.retention_seconds <= MAX_RETENTION_SECONDS:
            raise ValueError(
                f"retention_seconds must be in [0, {MAX_RETENTION_SECONDS}], got {self.retention_seconds}"
            )

    def to_json(self) -> str:
        record: dict[str, object] = {
            "timestamp": self.timestamp_ms,
            "input_length": self.input_length,
            "output_length": self.output_length,
            "hash_ids": list(self.hash_ids),
        }
        if self.session_id:
            record["session_id"] = self.session_id
        if self.retention_seconds is not None:
            record["retention_seconds"] = self.retention_seconds
        return json.dumps(record)

    @classmethod
    def from_json(cls, line: str) -> TraceRequest:
        record = json.loads(line)
        retention = record.get("retention_seconds")
        return cls(
            timestamp_ms=int(record["timestamp"]),
            input_length=int(record["input_length"]),
            output_length=int(record["output_length"]),
            hash_ids=tuple(int(block_id) for block_id in record["hash_ids"]),
            session_id=str(record.get("session_id") or ""),
            retention_seconds=None if retention is None else float(retention),
        )


def read_trace(path: Path) -> list[TraceRequest]:
    """Every request of a JSON-lines trace file, in file order (blank lines skipped)."""
    with path.open() as lines:
        return [TraceRequest.from_json(line) for line in lines if line.strip()]


def write_trace(path: Path, requests: Iterable[TraceRequest]) -> int:
    """Write ``requests`` as JSON lines; returns how many were written."""
    count = 0
    with path.open("w") as out:
        for request in requests:
            out.write(request.to_json() + "\n")
            count += 1
    return count
