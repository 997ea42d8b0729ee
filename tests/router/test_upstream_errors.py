"""Failures of the router's dependencies become the right public statuses."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from cachet.errors import (
    ERROR_INFO_METADATA_KEY,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    Unavailable,
)
from cachet.router.metrics import outcome_of
from cachet.router.upstream_errors import domain_error


def failed(code: grpc.StatusCode, details: str = "why", param: str = "") -> grpc.aio.AioRpcError:
    trailing = grpc.aio.Metadata()
    if param:
        trailing.add(
            ERROR_INFO_METADATA_KEY, InvalidArgument(details, param=param).error_info().SerializeToString()
        )
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), trailing, details)


def test_request_errors_keep_their_message_and_param() -> None:
    error = domain_error(failed(grpc.StatusCode.INVALID_ARGUMENT, "top_k must be >= 0", "top_k"), "engine")
    assert isinstance(error, InvalidArgument)
    assert (error.message, error.param) == ("top_k must be >= 0", "top_k")
    assert isinstance(domain_error(failed(grpc.StatusCode.NOT_FOUND), "tokenizer"), NotFound)
    assert isinstance(domain_error(failed(grpc.StatusCode.RESOURCE_EXHAUSTED), "engine"), ResourceExhausted)


@pytest.mark.parametrize("code", [grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED])
def test_a_dependency_down_is_unavailable_and_named(code: grpc.StatusCode) -> None:
    error = domain_error(failed(code, "connection refused 127.0.0.1:1"), "tokenizer")
    assert isinstance(error, Unavailable)
    assert "tokenizer" in error.message and "127.0.0.1" not in error.message


def test_other_failures_stay_internal_errors() -> None:
    original = failed(grpc.StatusCode.INTERNAL)
    assert domain_error(original, "engine") is original


def test_outcome_labels() -> None:
    assert outcome_of(None) == "ok"
    assert outcome_of(asyncio.CancelledError()) == "cancelled"
    assert outcome_of(ResourceExhausted("busy")) == "exhausted"
    assert outcome_of(Unavailable("down")) == "unavailable"
    assert outcome_of(KeyError("bug")) == "error"
