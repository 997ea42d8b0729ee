"""When a request reached each stage of its life in the engine, for its trace.

Stamped where each stage happens (the servicer, the scheduler, the shared tier's loader), in
wall-clock nanoseconds, which both of a replica's processes share; carried back on the
request's last output, from which the servicer records the engine's spans (``request_spans``).
A stage not reached stays 0.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class RequestTimeline:
    # The servicer built the request.
    arrived_ns: int = 0
    # The scheduler first gave it a seat (its queue wait ends).
    admitted_ns: int = 0
    # This replica sampled its first token (its prefill ends).
    first_token_ns: int = 0
    # Steps that computed part of its prompt (chunked prefill), first admission or after a
    # preemption.
    prefill_chunks: int = 0
    # Its prefix finished loading from the shared KV tier (a hand-off, or a shared-tier hit),
    # and how many blocks came.
    kv_loaded_ns: int = 0
    kv_loaded_blocks: int = 0
    # A hand-off (prefill replica): the blocks of its prompt handed over (sent to the decode
    # replica, written to the shared tier), their bytes on this rank, and when they were all
    # there and its answer left.
    kv_handed_off_blocks: int = 0
    kv_handed_off_bytes: int = 0
    kv_handed_off_ns: int = 0
