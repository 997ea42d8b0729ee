"""OpenTelemetry tracing: one trace spans every hop of a request.

W3C trace context travels in gRPC metadata through OpenTelemetry's own grpc.aio
interceptors (unary and streaming alike). The exporter follows the standard
variables: OTLP when ``OTEL_EXPORTER_OTLP_ENDPOINT`` is set (protocol from
``OTEL_EXPORTER_OTLP_PROTOCOL``, gRPC by default), console when
``OTEL_TRACES_EXPORTER=console``, otherwise spans are made (ids reach the logs)
but not exported.

``CACHET_TRACE_FILE=<path>`` adds (to whichever of the above) a file of finished
spans, one JSON object per line, written as each span ends: a collector-free
trace that tests and a developer can read with ``jq``. Every process may name
the same file: each span is one ``O_APPEND`` write, so lines never interleave.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Sequence
from typing import Any

import grpc
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.instrumentation.grpc import aio_client_interceptors, aio_server_interceptor
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    ConsoleSpanExporter,
    SimpleSpanProcessor,
    SpanExporter,
    SpanExportResult,
)
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

TRACE_FILE_VARIABLE = "CACHET_TRACE_FILE"

_TRACE_CONTEXT = TraceContextTextMapPropagator()

_configured = False


def _exporter_from_environment() -> SpanExporter | None:
    choice = os.environ.get("OTEL_TRACES_EXPORTER", "").lower()
    if choice == "none":
        return None
    if choice == "console":
        return ConsoleSpanExporter()
    if os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
        if os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc").startswith("http"):
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter

            return HttpExporter()
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        return OTLPSpanExporter()
    return None


class JsonLinesSpanExporter(SpanExporter):
    """Appends each finished span to a file as one JSON line (see ``span_record`` for the keys)."""

    def __init__(self, path: str) -> None:
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        # The engine ends spans on more than one thread; one write per batch keeps lines whole.
        self._lock = threading.Lock()

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        data = "".join(json.dumps(span_record(span), default=str) + "\n" for span in spans).encode()
        with self._lock:
            if self._fd < 0:
                return SpanExportResult.FAILURE
            os.write(self._fd, data)
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        with self._lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1


def span_record(span: ReadableSpan) -> dict[str, Any]:
    """The flat form a reader needs to rebuild a trace: ids in W3C hex, times in Unix nanoseconds."""
    context = span.get_span_context()
    assert context is not None  # SDK spans always carry one
    return {
        "service": span.resource.attributes.get(SERVICE_NAME, ""),
        "name": span.name,
        "kind": span.kind.name,
        "trace_id": format(context.trace_id, "032x"),
        "span_id": format(context.span_id, "016x"),
        "parent_span_id": format(span.parent.span_id, "016x") if span.parent is not None else None,
        "start_ns": span.start_time,
        "end_ns": span.end_time,
        "status": span.status.status_code.name,
        "attributes": dict(span.attributes or {}),
    }


def configure_tracing(service: str, extra_processor: SpanProcessor | None = None) -> TracerProvider:
    """Install the process-wide tracer provider once; later calls return it unchanged."""
    global _configured
    provider = trace.get_tracer_provider()
    if _configured and isinstance(provider, TracerProvider):
        return provider
    provider = TracerProvider(
        resource=Resource.create({SERVICE_NAME: os.environ.get("OTEL_SERVICE_NAME", service)})
    )
    exporter = _exporter_from_environment()
    if exporter is not None:
        provider.add_span_processor(BatchSpanProcessor(exporter))
    if trace_file := os.environ.get(TRACE_FILE_VARIABLE):
        # Simple, not batched: a span is on disk when it ends, so a reader (or a killed
        # process) never waits on a flush. One small write per span; not for production load.
        provider.add_span_processor(SimpleSpanProcessor(JsonLinesSpanExporter(trace_file)))
    if extra_processor is not None:
        provider.add_span_processor(extra_processor)
    trace.set_tracer_provider(provider)
    _configured = True
    return provider


def get_tracer(name: str) -> trace.Tracer:
    return trace.get_tracer(name)


def current_traceparent() -> str:
    """The current span's W3C traceparent ("" outside a traced context), for work that
    leaves the call it belongs to, such as a usage record sent later in a batch."""
    carrier: dict[str, str] = {}
    _TRACE_CONTEXT.inject(carrier)
    return carrier.get("traceparent", "")


def context_from_traceparent(traceparent: str) -> Context | None:
    """The context a span started from ``traceparent`` should have as its parent (None: a new trace)."""
    if not traceparent:
        return None
    return _TRACE_CONTEXT.extract({"traceparent": traceparent})


def server_interceptors() -> list[grpc.aio.ServerInterceptor]:
    return [aio_server_interceptor()]


def client_interceptors() -> list[grpc.aio.ClientInterceptor]:
    return list(aio_client_interceptors())
