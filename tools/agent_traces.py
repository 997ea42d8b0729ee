"""Agent-like prefix-reuse traces: many sessions, many turns, each turn resending the whole conversation.

The shape of one session (all lengths in whole blocks of ``block_tokens``):

* turn 0: the shared prefix (system prompt + tool schemas, the same ids in every
  session) followed by the session's task (user message, repository context);
* turn k > 0: turn k-1's prompt, then turn k-1's answer and the tool output it
  asked for. So turn k's ``hash_ids`` are turn k-1's with blocks appended.

Prompts are whole blocks: the tool output is padded so that answer + tool output
fill whole blocks, which keeps every prompt block full and lets equal ids stand for
equal content. Sessions start uniformly over ``start_window_ms``; a turn's next
one arrives once its answer is complete (the whole prompt prefilled and the output
decoded at the shape's rates, so an agent never overlaps itself even when nothing
was cached) and the tool has run (a uniform latency); sessions interleave in time.
Block ids: the shared prefix is ``0 .. shared_prefix_blocks-1``; every other id is
fresh. The same shape and seed always give the same trace.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from cachet.tools.trace import TraceRequest


@dataclass(frozen=True)
class AgentTraceShape:
    sessions: int = 64
    turns: int = 16
    block_tokens: int = 512
    # System prompt + tool schemas: 4,096 tokens shared by every session.
    shared_prefix_blocks: int = 8
    # The first user message with its context: 1 to 8 blocks.
    task_blocks: tuple[int, int] = (1, 8)
    output_tokens: tuple[int, int] = (20, 600)
    tool_output_tokens: tuple[int, int] = (50, 3000)
    tool_latency_ms: tuple[int, int] = (200, 10_000)
    # How fast an answer comes back before its tool runs (the replay's default service model).
    prefill_tokens_per_s: float = 10_000.0
    decode_tokens_per_s: float = 50.0
    start_window_ms: int = 300_000

    def __post_init__(self) -> None:
        if self.sessions < 1 or self.turns < 1 or self.block_tokens < 1:
            raise ValueError("sessions, turns and block_tokens must be positive")


def agent_trace(shape: AgentTraceShape = AgentTraceShape(), *, seed: int = 0) -> list[TraceRequest]:
    """Every turn of every session, in timestamp order (ties: session order, then turn order)."""
    draw = random.Random(seed)
    next_id = shape.shared_prefix_blocks
    requests: list[TraceRequest] = []
    for session in range(shape.sessions):
        turns, next_id = _session(shape, draw, f"session-{session}", next_id)
        requests.extend(turns)
    # sorted() is stable, and sessions were generated in order with their turns in order.
    return sorted(requests, key=lambda request: request.timestamp_ms)


def _session(
    shape: AgentTraceShape, draw: random.Random, session_id: str, next_id: int
) -> tuple[list[TraceRequest], int]:
    """One session's turns, and the first block id it left unused."""
    task = draw.randint(*shape.task_blocks)
    hash_ids = [*range(shape.shared_prefix_blocks), *range(next_id, next_id + task)]
    next_id += task
    timestamp = draw.randrange(shape.start_window_ms)
    turns: list[TraceRequest] = []
    for turn in range(shape.turns):
        output = draw.randint(*shape.output_tokens)
        prompt = len(hash_ids) * shape.block_tokens
        turns.append(
            TraceRequest(
                timestamp_ms=timestamp,
                input_length=prompt,
                output_length=output,
                hash_ids=tuple(hash_ids),
                session_id=session_id,
            )
        )
        if turn == shape.turns - 1:
            break
        # The answer and the tool output, padded to whole blocks, join the conversation.
        appended = math.ceil((output + draw.randint(*shape.tool_output_tokens)) / shape.block_tokens)
        hash_ids.extend(range(next_id, next_id + appended))
        next_id += appended
        # The answer is complete before the tool runs, even if none of the prompt was cached.
        answer_ms = 1000.0 * (prompt / shape.prefill_tokens_per_s + output / shape.decode_tokens_per_s)
        timestamp += math.ceil(answer_ms) + draw.randint(*shape.tool_latency_ms)
    return turns, next_id
