"""Failures of the services the router calls, turned into the router's own domain errors.

A client of the public API should see *why* its request failed (its prompt is too
long, the model does not exist, capacity is short), never the name of an internal
hop. Codes that describe the request travel through unchanged with the upstream
message; a dependency being down becomes UNAVAILABLE; anything else is a bug and
stays an error the interceptor reports as INTERNAL.
"""

from __future__ import annotations

import grpc

from cachet.errors import (
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    Unavailable,
    error_info_from_metadata,
)

_DOWN = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED}


def domain_error(error: grpc.aio.AioRpcError, service: str) -> Exception:
    """The error to raise for a failed call to ``service`` ("tokenizer", "engine", ...)."""
    code, details = error.code(), error.details() or ""
    param = error_info_from_metadata(error.trailing_metadata()).param
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return InvalidArgument(details, param=param)
    if code == grpc.StatusCode.NOT_FOUND:
        return NotFound(details, param=param)
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return ResourceExhausted(details or f"{service} is at capacity")
    if code in _DOWN:
        return Unavailable(f"the {service} service is unavailable; retry shortly")
    return error
