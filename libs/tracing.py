"""OpenTelemetry tracing: one trace spans every hop of a request.

W3C trace context travels in gRPC metadata through OpenTelemetry's own grpc.aio
interceptors (unary and streaming alike). The exporter follows the standard
variables: OTLP when ``OTEL_EXPORTER_OTLP_ENDPOINT`` is set (protocol from
``OTEL_EXPORTER_OTLP_PROTOCOL``, gRPC by default), console when
``OTEL_TRACES_EXPORTER=console``, otherwise spans are made (ids reach the logs)
but not exported.
"""

from __future__ import annotations

import os

import grpc
from opentelemetry import trace
from opentelemetry.instrumentation.grpc import aio_client_interceptors, aio_server_interceptor
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SpanExporter

_configured = False


def _exporter_from_environment() -> SpanExporter | None:
    choice = os.environ.get("OTEL_TRACES_EXPORTER", "").lower()
    if choice == "none":
        return None
    if choice == "console":
        return ConsoleSpanExporter()
    if os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
        if os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc").startswith("http"):
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        else:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        return OTLPSpanExporter()
    return None


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
    if extra_processor is not None:
        provider.add_span_processor(extra_processor)
    trace.set_tracer_provider(provider)
    _configured = True
    return provider


def get_tracer(name: str) -> trace.Tracer:
    return trace.get_tracer(name)


def server_interceptors() -> list[grpc.aio.ServerInterceptor]:
    return [aio_server_interceptor()]


def client_interceptors() -> list[grpc.aio.ClientInterceptor]:
    return list(aio_client_interceptors())
