"""structlog JSON logging with the current trace and span ids on every line."""

from __future__ import annotations

import logging
import sys

import structlog
from opentelemetry import trace
from structlog.typing import EventDict, Processor


def _add_trace_context(_logger: object, _method: str, event: EventDict) -> EventDict:
    span_context = trace.get_current_span().get_span_context()
    if span_context.is_valid:
        event["trace_id"] = format(span_context.trace_id, "032x")
        event["span_id"] = format(span_context.span_id, "016x")
    return event


class _StreamTeardownDetachFilter(logging.Filter):
    """Drops OpenTelemetry's "Failed to detach context" when the token belongs to another Context.

    grpc.aio can leave a streaming handler suspended at a ``yield`` when the client cancels;
    the event loop then closes the generator from a task of its own, and the OpenTelemetry
    server interceptor's span context, attached in the handler's task, cannot be detached
    there (open-telemetry/opentelemetry-python-contrib#2357). The span still ends; only the
    reset of a context variable in a Context that is gone fails. Every cancelled load-report
    stream logged it as an ERROR with a traceback. Other detach failures still show.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        if record.getMessage() != "Failed to detach context" or record.exc_info is None:
            return True
        error = record.exc_info[1]
        return not (isinstance(error, ValueError) and "was created in a different Context" in str(error))


def configure_logging(service: str, level: str = "info") -> None:
    """JSON lines on stderr; stdlib loggers (grpc, uvicorn) go through the same renderer."""
    shared: list[Processor] = [
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
    context_logger = logging.getLogger("opentelemetry.context")
    if not any(isinstance(f, _StreamTeardownDetachFilter) for f in context_logger.filters):
        context_logger.addFilter(_StreamTeardownDetachFilter())


def get_logger(name: str) -> structlog.stdlib.BoundLogger:
    return structlog.get_logger(name)
