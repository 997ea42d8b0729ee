"""The engine's spans of one request, as children of its Generate call's span.

The loop process has no trace context (and must not block on an exporter), so the request's
stages are stamped there (``RequestTimeline``) and the spans are recorded here, in the server
process, when the request ends, with the stamped times: queue wait, KV load from the shared
tier (a disaggregated prefill's hand-off), prefill and decode; on a prefill replica, the
hand-off of its KV after the prefill.
"""

from __future__ import annotations

import time

from cachet.engine.request_output import RequestOutput
from cachet.tracing import get_tracer

_tracer = get_tracer(__name__)


def record_request_spans(output: RequestOutput) -> None:
    """Record the spans of a finished request (its last output carries its timeline)."""
    timeline = output.timeline
    if timeline is None or not timeline.arrived_ns:
        return
    ended = time.time_ns()
    admitted = timeline.admitted_ns or ended
    first_token = timeline.first_token_ns or ended
    _span("engine.queue", timeline.arrived_ns, admitted)
    if timeline.kv_loaded_ns:
        _span(
            "engine.kv_load",
            timeline.arrived_ns,
            timeline.kv_loaded_ns,
            {"cachet.kv_blocks": timeline.kv_loaded_blocks},
        )
    if timeline.admitted_ns:
        _span(
            "engine.prefill",
            admitted,
            first_token,
            {
                "cachet.prompt_tokens": output.num_prompt_tokens,
                "cachet.cached_tokens": output.num_cached_tokens,
                "cachet.prefill_chunks": timeline.prefill_chunks,
            },
        )
    if timeline.first_token_ns:
        _span("engine.decode", first_token, ended, {"cachet.completion_tokens": output.num_completion_tokens})
    if timeline.kv_handed_off_ns:
        # A hand-off's blocks on their way to the decode replica (pushed, written), after its
        # prefill: its answer waited for them.
        _span(
            "engine.kv_handoff",
            first_token,
            timeline.kv_handed_off_ns,
            {
                "cachet.kv_blocks": timeline.kv_handed_off_blocks,
                "cachet.kv_bytes": timeline.kv_handed_off_bytes,
            },
        )


def _span(name: str, start_ns: int, end_ns: int, attributes: dict[str, int] | None = None) -> None:
    span = _tracer.start_span(name, start_time=start_ns, attributes=attributes)
    span.end(end_time=max(start_ns, end_ns))
