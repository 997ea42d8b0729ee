"""structlog JSON logging with the current trace and span ids on every line."""

from __future__ import annotations

import logging
import sys

import structlog
from opentelemetry import trace


def _add_trace_context(_logger: object, _method: str, event: dict) -> dict:
    span_context = trace.get_current_span().get_span_context()
    if span_context.is_valid:
        event["trace_id"] = format(span_context.trace_id, "032x")
        event["span_id"] = format(span_context.span_id, "016x")
    return event


def configure_logging(service: str, level: str = "info") -> None:
    """JSON lines on stderr; stdlib loggers (grpc, uvicorn) go through the same renderer."""
    shared = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        _add_trace_context,
    ]
    structlog.configure(
        processors=[*shared, structlog.processors.format_exc_info, structlog.processors.JSONRenderer()],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelName(level.upper())),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )
    structlog.contextvars.bind_contextvars(service=service)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            processors=[
                structlog.stdlib.ProcessorFormatter.remove_processors_meta,
                structlog.processors.JSONRenderer(),
            ],
            foreign_pre_chain=[*shared, structlog.stdlib.add_logger_name],
        )
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())


def get_logger(name: str) -> structlog.stdlib.BoundLogger:
    return structlog.get_logger(name)
