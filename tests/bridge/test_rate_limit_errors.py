"""A key's limit refusal from the router, rendered: OpenAI's 429 with x-ratelimit-* headers, Anthropic's
429 rate_limit_error (not the 529 of a service short of capacity)."""

from __future__ import annotations

import grpc

from cachet.bridge.errors import from_rpc_error, openai_duration
from cachet.common.v1 import common_pb2
from cachet.errors import ERROR_INFO_METADATA_KEY


def refusal(info: common_pb2.ErrorInfo, message: str = "over") -> grpc.aio.AioRpcError:
    trailing = grpc.aio.Metadata((ERROR_INFO_METADATA_KEY, info.SerializeToString()))
    return grpc.aio.AioRpcError(grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.aio.Metadata(), trailing, message)


def test_a_request_limit_refusal_carries_openai_s_headers() -> None:
    limits = common_pb2.RateLimits(limit_requests=60, remaining_requests=0, reset_requests_ms=1500)
    info = common_pb2.ErrorInfo(
        type="requests", code="rate_limit_exceeded", retry_after_seconds=2, rate_limits=limits
    )
    error = from_rpc_error(refusal(info), "trace")
    response = error.response()
    assert response.status_code == 429
    assert response.headers["x-ratelimit-limit-requests"] == "60"
    assert response.headers["x-ratelimit-remaining-requests"] == "0"
    assert response.headers["x-ratelimit-reset-requests"] == "1.5s"
    assert response.headers["retry-after"] == "2"
    assert "x-ratelimit-limit-tokens" not in response.headers
    anthropic = error.anthropic_response()
    assert anthropic.status_code == 429
    assert b'"rate_limit_error"' in anthropic.body


def test_capacity_refusals_keep_their_shape() -> None:
    error = from_rpc_error(refusal(common_pb2.ErrorInfo(type="rate_limit_exceeded")), "trace")
    assert error.response().status_code == 429
    assert "x-ratelimit-limit-requests" not in error.response().headers
    assert error.anthropic_response().status_code == 529


def test_resets_are_written_as_openai_writes_them() -> None:
    assert [openai_duration(ms) for ms in (20, 1000, 1500, 60_000, 360_000, 3_723_500)] == [
        "20ms",
        "1s",
        "1.5s",
        "1m0s",
        "6m0s",
        "1h2m3.5s",
    ]
