"""Service logs: OpenTelemetry's known stream-teardown detach failure is dropped, others stay."""

from __future__ import annotations

import contextvars
import logging
from collections.abc import Iterator

import pytest
from opentelemetry import context

from cachet.logs import configure_logging


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture
def context_log() -> Iterator[list[logging.LogRecord]]:
    """What reaches handlers from OpenTelemetry's context logger once a service configured logging."""
    configure_logging("test")
    collect = _Collect()
    logger = logging.getLogger("opentelemetry.context")
    logger.addHandler(collect)
    yield collect.records
    logger.removeHandler(collect)


def test_a_detach_from_another_context_is_dropped(context_log: list[logging.LogRecord]) -> None:
    # Attached here, detached in another Context: a stream generator closed by another task.
    token = context.attach(context.set_value("k", "v"))
    contextvars.Context().run(context.detach, token)
    assert context_log == []


def test_other_detach_failures_still_log_an_error(context_log: list[logging.LogRecord]) -> None:
    token = context.attach(context.set_value("k", "v"))
    context.detach(token)
    context.detach(token)  # used twice: a real bug somewhere, not the stream teardown
    [record] = context_log
    assert record.getMessage() == "Failed to detach context" and record.levelno == logging.ERROR
    assert record.exc_info is not None and isinstance(record.exc_info[1], RuntimeError)
