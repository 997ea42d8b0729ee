"""The router's Prometheus metrics (served on its ``metrics_port``, 9091 by default)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator, Sequence

from prometheus_client import Counter, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from cachet.errors import CachetError, InvalidArgument, NotFound, ResourceExhausted, Unauthenticated
from cachet.event_loop_lag import LAG_BUCKETS

REQUESTS = Counter(
    "cachet_router_requests_total",
    "Completion requests by how they ended.",
    ["outcome"],  # ok, cancelled, invalid, not_found, unauthenticated, exhausted, unavailable, error
)
TIME_TO_FIRST_TOKEN = Histogram(
    "cachet_router_time_to_first_token_seconds",
    "From request arrival to the first chunk sent to the client, which goes with the first generated token.",
    buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
)
TIME_PER_OUTPUT_TOKEN = Histogram(
    "cachet_router_time_per_output_token_seconds",
    "Per request, first chunk to last over the tokens generated after the first (TPOT, as vLLM counts it).",
    buckets=(0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1, 2.5),
)
EVENT_LOOP_LAG = Histogram(
    "cachet_router_event_loop_lag_seconds",
    "How late the router's event loop ran a callback that was due (every request's messages wait there).",
    buckets=LAG_BUCKETS,
)
PROMPT_TOKENS = Counter("cachet_router_prompt_tokens_total", "Prompt tokens of finished requests.")
CACHED_TOKENS = Counter("cachet_router_cached_tokens_total", "Prompt tokens served from the prefix cache.")
COMPLETION_TOKENS = Counter("cachet_router_completion_tokens_total", "Generated tokens.")
PLACEMENTS = Counter("cachet_router_placements_total", "Replica choices by rule.", ["reason"])
ENGINE_RETRIES = Counter(
    "cachet_router_engine_retries_total", "Requests moved to another replica after a refusal."
)
PREFILL_HANDOFFS = Counter(
    "cachet_router_prefill_handoffs_total",
    "Prompts sent to a prefill replica, by outcome: handed_off (decoded elsewhere from its KV), "
    "stopped (its first token ended the answer), failed or busy (run whole on a decode replica).",
    ["outcome"],
)
PREFILL_HANDOFF_SECONDS = Histogram(
    "cachet_router_prefill_handoff_seconds",
    "From sending a prompt to a prefill replica to its answer, KV written to the shared tier.",
    buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
)
QUEUE_JOBS_STARTED = Counter(
    "cachet_router_queue_jobs_started_total",
    "Queued jobs this router's dispatcher sent to an engine (a job run again counts again).",
)
QUEUE_JOBS_REQUEUED = Counter(
    "cachet_router_queue_jobs_requeued_total",
    "Leased jobs handed back to the queue: the engine refused them for capacity or was unreachable.",
)
QUEUE_RESULTS = Counter(
    "cachet_router_queue_results_total",
    "Job results this router wrote; duplicate: another attempt's result was already kept.",
    ["outcome"],  # stored, duplicate
)
QUEUE_COMPLETIONS_PER_COMMIT = Histogram(
    "cachet_router_queue_completions_per_commit",
    "Job results written by one store transaction (completions arriving together share it).",
    buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256),
)

QUEUE_JOB_STAGE_SECONDS = Histogram(
    "cachet_router_queue_job_stage_seconds",
    "A queued job's life by stage: lease (the store transaction that leased it, shared with the"
    " jobs leased beside it), start (leased to the engine's first output: the Generate call,"
    " admission, the prefill step), generate (first output to last), record (the engine done"
    " to the result stored: usage flush, store commit).",
    ["stage"],
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
)


class QueueCollector(Collector):
    """Jobs in the queue store by state, read at scrape time: the backlog every router sharing
    the store sees, so each reports the same figure."""

    def __init__(self, counts: Callable[[float], dict[str, int]], states: Sequence[str]) -> None:
        self._counts = counts
        self._states = states

    def collect(self) -> Iterator[Metric]:
        family = GaugeMetricFamily(
            "cachet_router_queue_jobs", "Jobs in the queue store, by state.", labels=["state"]
        )
        try:
            counts = self._counts(5.0)
        except Exception:  # noqa: BLE001 - a store that is closing or slow leaves this scrape without the figure
            return
        for state in self._states:
            family.add_metric([state], counts.get(state, 0))
        yield family


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
