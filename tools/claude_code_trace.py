"""Replay traces from real Claude Code sessions: their logs (or the summaries of them) to the trace format.

Claude Code's ``--output-format stream-json`` log has one JSON object a line. The
main thread's ``assistant`` lines (``parent_tool_use_id`` null) carry each API
call's ``usage``: ``input_tokens + cache_creation_input_tokens +
cache_read_input_tokens`` is that call's whole prompt, because the agent resends
the conversation every turn. The closing ``result`` line carries the session's
totals (the same three counters summed over its calls, ``output_tokens``) and
its wall time (``duration_ms``: model time plus tool time).

``session_from_log`` reads a whole log into a ``SessionShape``: the exact prompt
size of every call. Where only the ``result`` line is kept (as in
``bench/traces/claude_code_sessions.jsonl``: the numbers of public sessions
without their content), ``session_from_summary`` rebuilds the calls from the
totals: the last prompt is the tokens ever written to the cache (each token of
the conversation is written once), the first is the system prompt + tools +
task, prompts grow linearly in between, and the number of calls is the one for
which those prompts add up to the total prompt tokens.

``claude_code_trace`` then draws sessions from those shapes (bootstrap: each
drawn session is a fresh conversation of the same shape), starts them uniformly
over a window, spaces each session's calls by its own mean time per call (x a
uniform 0.5-1.5 jitter, so sessions do not march in step), and names the blocks:
the first ``shared_prefix_tokens`` (Claude Code's system prompt and tool schemas,
the same for every session of one version) share ids across sessions; the rest
are the session's own. A prompt's last, partial block gets an id of its own that
no later call reuses: an engine caches only full blocks.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from cachet.tools.trace import TraceRequest

# The first call of the public Opus session whose first line we read: system prompt, tool
# schemas, skills list and task. Used where a summary does not say.
DEFAULT_FIRST_PROMPT_TOKENS = 18_259
DEFAULT_SHARED_PREFIX_TOKENS = 12_000


@dataclass(frozen=True)
class SessionShape:
    """One real session: every call's prompt and output size, and its wall time."""

    source: str
    prompt_tokens: tuple[int, ...]
    output_tokens: tuple[int, ...]
    duration_ms: int

    def __post_init__(self) -> None:
        if not self.prompt_tokens or len(self.prompt_tokens) != len(self.output_tokens):
            raise ValueError(
                f"{self.source}: a session needs one output size per call, and at least one call"
            )


def session_from_summary(record: dict) -> SessionShape:
    """A session rebuilt from the ``result`` line's totals (see the module docstring)."""
    total = int(record["input_tokens"]) + int(record["cache_creation_input_tokens"])
    total += int(record["cache_read_input_tokens"])
    last = max(1, int(record["cache_creation_input_tokens"]))
    first = min(int(record.get("first_prompt_tokens") or DEFAULT_FIRST_PROMPT_TOKENS), last)
    calls = max(1, round(2 * total / (first + last)))
    step = (last - first) / (calls - 1) if calls > 1 else 0.0
    prompts = tuple(round(first + i * step) for i in range(calls))
    outputs = _spread(int(record["output_tokens"]), calls)
    duration = int(record.get("duration_ms") or record.get("duration_api_ms") or 0)
    return SessionShape(str(record.get("source", "")), prompts, outputs, duration)


def session_from_log(path: Path) -> SessionShape:
    """A session with the exact prompt of every main-thread call of a stream-json log."""
    usage_by_message: dict[str, dict] = {}
    duration = 0
    with path.open() as lines:
        for line in lines:
            if not line.strip():
                continue
            event = json.loads(line)
            if event.get("type") == "result":
                duration = int(event.get("duration_ms") or 0)
            elif event.get("type") == "assistant" and event.get("parent_tool_use_id") is None:
                message = event.get("message") or {}
                # One API call streams several lines (one per content block) under one id.
                usage_by_message[message.get("id", "")] = message.get("usage") or {}
    prompts = tuple(
        int(u.get("input_tokens", 0))
        + int(u.get("cache_creation_input_tokens", 0))
        + int(u.get("cache_read_input_tokens", 0))
        for u in usage_by_message.values()
    )
    outputs = tuple(max(1, int(u.get("output_tokens", 1))) for u in usage_by_message.values())
    return SessionShape(str(path), prompts, outputs, duration)


def read_sessions(path: Path) -> list[SessionShape]:
    """A Claude Code stream-json log (one session), or a file of summary lines (one session each)."""
    with path.open() as lines:
        first = next((line for line in lines if line.strip()), "")
    if not first:
        raise ValueError(f"{path} is empty")
    record = json.loads(first)
    if "type" in record:
        return [session_from_log(path)]
    return read_session_summaries(path)


def read_session_summaries(path: Path) -> list[SessionShape]:
    """Every summary line of a JSON-lines file (the shape of ``bench/traces/claude_code_sessions.jsonl``)."""
    with path.open() as lines:
        return [session_from_summary(json.loads(line)) for line in lines if line.strip()]


@dataclass(frozen=True)
class ClaudeCodeTraceShape:
    sessions: int = 72
    block_tokens: int = 64
    shared_prefix_tokens: int = DEFAULT_SHARED_PREFIX_TOKENS
    # Sessions start uniformly over this window: 10 minutes.
    start_window_ms: int = 600_000

    def __post_init__(self) -> None:
        if self.sessions < 1 or self.block_tokens < 1 or self.shared_prefix_tokens < 0:
            raise ValueError("sessions and block_tokens must be positive, shared_prefix_tokens not negative")


def claude_code_trace(
    shapes: Sequence[SessionShape], shape: ClaudeCodeTraceShape = ClaudeCodeTraceShape(), *, seed: int = 0
) -> list[TraceRequest]:
    """``shape.sessions`` sessions drawn from ``shapes``, every call of each, in timestamp order."""
    if not shapes:
        raise ValueError("no session to draw from")
    draw = random.Random(seed)
    shared = shape.shared_prefix_tokens // shape.block_tokens
    ids = _BlockIds(first_free=shared)
    requests: list[TraceRequest] = []
    for session in range(shape.sessions):
        drawn = draw.choice(shapes)
        requests.extend(_session(drawn, f"session-{session}", shape, shared, ids, draw))
    # sorted() is stable: equal timestamps keep session order, then call order.
    return sorted(requests, key=lambda request: request.timestamp_ms)


class _BlockIds:
    """Fresh block ids, never handed out twice."""

    def __init__(self, first_free: int) -> None:
        self._next = first_free

    def take(self, count: int) -> list[int]:
        taken = list(range(self._next, self._next + count))
        self._next += count
        return taken


def _session(
    shape: SessionShape,
    session_id: str,
    trace_shape: ClaudeCodeTraceShape,
    shared: int,
    ids: _BlockIds,
    draw: random.Random,
) -> Iterable[TraceRequest]:
    block = trace_shape.block_tokens
    full_blocks = max(prompt // block for prompt in shape.prompt_tokens)
    # Block i of the conversation: shared ids first (never past the conversation), then its own.
    own = min(shared, full_blocks)
    chain = [*range(own), *ids.take(full_blocks - own)]
    per_call_ms = shape.duration_ms / len(shape.prompt_tokens)
    timestamp = float(draw.randrange(max(1, trace_shape.start_window_ms)))
    for prompt, output in zip(shape.prompt_tokens, shape.output_tokens, strict=True):
        full, partial = divmod(prompt, block)
        hash_ids = chain[:full] + (ids.take(1) if partial else [])
        yield TraceRequest(round(timestamp), prompt, output, tuple(hash_ids), session_id)
        timestamp += per_call_ms * draw.uniform(0.5, 1.5)


def _spread(total: int, parts: int) -> tuple[int, ...]:
    """``total`` cut into ``parts`` near-equal positive shares."""
    base, extra = divmod(max(total, parts), parts)
    return tuple(base + (1 if i < extra else 0) for i in range(parts))


def describe(shapes: Sequence[SessionShape]) -> str:
    """One line for people: how many sessions and calls, and how long their contexts grew."""
    calls = sum(len(s.prompt_tokens) for s in shapes)
    longest = [max(s.prompt_tokens) for s in shapes]
    return (
        f"{len(shapes)} sessions, {calls} calls; final context {min(longest)}-{max(longest)} tokens "
        f"(median {sorted(longest)[len(longest) // 2]}); {math.fsum(s.duration_ms for s in shapes) / 1000:.0f} s"
    )
