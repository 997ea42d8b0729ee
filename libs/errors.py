"""Domain errors and the one table that maps them to gRPC status codes.

Services raise these; ``cachet.grpc_server``'s interceptor turns them into a
status with a message and an ``ErrorInfo`` in the trailing metadata, and the
bridge turns that into OpenAI's error JSON and an HTTP status. Nothing else
catches-and-converts errors.
"""

from __future__ import annotations

from dataclasses import dataclass

import grpc

from cachet.common.v1 import common_pb2

ERROR_INFO_METADATA_KEY = "cachet-error-info-bin"
# A managed key's per-minute limits and what is left of them (common.v1.RateLimits), in the
# initial metadata of a call the router admitted: the REST bridge's x-ratelimit-* headers.
RATE_LIMITS_METADATA_KEY = "cachet-rate-limits-bin"


@dataclass
class CachetError(Exception):
    """Base of every error a caller should see as a clean status, never INTERNAL."""

    message: str
    param: str = ""
    code_name: str = ""
    status: grpc.StatusCode = grpc.StatusCode.UNKNOWN
    error_type: str = "api_error"
    retry_after_seconds: int = 0

    def __post_init__(self) -> None:
        super().__init__(self.message)

    def __str__(self) -> str:
        return self.message

    def error_info(self) -> common_pb2.ErrorInfo:
        return common_pb2.ErrorInfo(
            type=self.error_type,
            param=self.param,
            code=self.code_name,
            retry_after_seconds=self.retry_after_seconds,
        )


@dataclass
class InvalidArgument(CachetError):
    """The request is wrong; retrying it unchanged will fail again."""

    status: grpc.StatusCode = grpc.StatusCode.INVALID_ARGUMENT
    error_type: str = "invalid_request_error"


@dataclass
class PermissionDenied(CachetError):
    """The caller is known but may not do this (an operator's view asked by another account)."""

    status: grpc.StatusCode = grpc.StatusCode.PERMISSION_DENIED
    error_type: str = "permission_error"


@dataclass
class NotFound(CachetError):
    """The named model, request or batch does not exist (for this caller)."""

    status: grpc.StatusCode = grpc.StatusCode.NOT_FOUND
    error_type: str = "not_found_error"


@dataclass
class Unauthenticated(CachetError):
    """No or unknown credentials."""

    status: grpc.StatusCode = grpc.StatusCode.UNAUTHENTICATED
    error_type: str = "authentication_error"


@dataclass
class ResourceExhausted(CachetError):
    """Over capacity right now; worth retrying after ``retry_after_seconds``."""

    status: grpc.StatusCode = grpc.StatusCode.RESOURCE_EXHAUSTED
    error_type: str = "rate_limit_exceeded"
    retry_after_seconds: int = 1


@dataclass
class Unavailable(CachetError):
    """A dependency is down; the caller may retry elsewhere or later."""

    status: grpc.StatusCode = grpc.StatusCode.UNAVAILABLE
    error_type: str = "service_unavailable"
    retry_after_seconds: int = 1


@dataclass
class Aborted(CachetError):
    """The request was cancelled before it finished."""

    status: grpc.StatusCode = grpc.StatusCode.CANCELLED
    error_type: str = "request_cancelled"


def error_info_from_metadata(metadata: grpc.aio.Metadata | None) -> common_pb2.ErrorInfo:
    """The ErrorInfo a failed call carried, or an empty one."""
    info = common_pb2.ErrorInfo()
    for key, value in metadata or ():
        if key == ERROR_INFO_METADATA_KEY and isinstance(value, bytes):
            info.ParseFromString(value)
    return info
