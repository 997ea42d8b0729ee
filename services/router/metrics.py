"""The router's Prometheus metrics (served on ``metrics_port`` when set)."""

from __future__ import annotations

import asyncio

from prometheus_client import Counter, Histogram

from cachet.errors import CachetError, InvalidArgument, NotFound, ResourceExhausted, Unauthenticated

REQUESTS = Counter(
    "cachet_router_requests_total",
    "Completion requests by how they ended.",
    ["outcome"],  # ok, cancelled, invalid, not_found, unauthenticated, exhausted, unavailable, error
)
TIME_TO_FIRST_TOKEN = Histogram(
    "cachet_router_time_to_first_token_seconds",
    "From request arrival to the first generated text sent to the client.",
    buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
)
PROMPT_TOKENS = Counter("cachet_router_prompt_tokens_total", "Prompt tokens of finished requests.")
CACHED_TOKENS = Counter("cachet_router_cached_tokens_total", "Prompt tokens served from the prefix cache.")
COMPLETION_TOKENS = Counter("cachet_router_completion_tokens_total", "Generated tokens.")
PLACEMENTS = Counter("cachet_router_placements_total", "Replica choices by rule.", ["reason"])
ENGINE_RETRIES = Counter(
    "cachet_router_engine_retries_total", "Requests moved to another replica after a refusal."
)


def outcome_of(error: BaseException | None) -> str:
    """The ``outcome`` label of a request that ended with ``error`` (None: success)."""
    if error is None:
        return "ok"
    if isinstance(error, asyncio.CancelledError | GeneratorExit):
        return "cancelled"
    labels = {
        InvalidArgument: "invalid",
        NotFound: "not_found",
        Unauthenticated: "unauthenticated",
        ResourceExhausted: "exhausted",
    }
    for kind, label in labels.items():
        if isinstance(error, kind):
            return label
    return "unavailable" if isinstance(error, CachetError) else "error"
