"""Every failure is OpenAI-shaped with the right HTTP status: gRPC statuses, validation, size, crashes."""

from __future__ import annotations

import re

import grpc
import pytest

from cachet.bridge.app import create_app
from cachet.bridge.errors import from_rpc_error
from cachet.common.v1 import common_pb2
from cachet.errors import ERROR_INFO_METADATA_KEY
from cachet.logs import configure_logging
from cachet.tracing import configure_tracing

from .conftest import bridge_settings, serve_in_process

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
TRACEPARENT = f"00-{TRACE_ID}-00f067aa0ba902b7-01"
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def rpc_error(
    code: grpc.StatusCode, details: str, info: common_pb2.ErrorInfo | None = None
) -> grpc.aio.AioRpcError:
    """The error object grpc.aio raises for a failed call, with the ErrorInfo services attach."""
    trailing = grpc.aio.Metadata()
    if info is not None:
        trailing.add(ERROR_INFO_METADATA_KEY, info.SerializeToString())
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), trailing, details)


@pytest.mark.parametrize(
    ("code", "status", "error_type"),
    [
        (grpc.StatusCode.INVALID_ARGUMENT, 400, "invalid_request_error"),
        (grpc.StatusCode.UNAUTHENTICATED, 401, "authentication_error"),
        (grpc.StatusCode.PERMISSION_DENIED, 403, "permission_error"),
        (grpc.StatusCode.NOT_FOUND, 404, "not_found_error"),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, 429, "rate_limit_exceeded"),
        (grpc.StatusCode.UNIMPLEMENTED, 501, "not_implemented"),
        (grpc.StatusCode.UNAVAILABLE, 503, "service_unavailable"),
        (grpc.StatusCode.DEADLINE_EXCEEDED, 503, "service_unavailable"),
    ],
)
def test_status_table(code: grpc.StatusCode, status: int, error_type: str) -> None:
    error = from_rpc_error(rpc_error(code, "what went wrong"), trace_id="t")
    response = error.response()
    assert response.status_code == status
    assert error.body() == {
        "error": {"message": "what went wrong", "type": error_type, "param": None, "code": None}
    }
    # Retry-After on exactly the statuses worth retrying, defaulting to 1 s.
    assert response.headers.get("retry-after") == ("1" if status in (429, 503) else None)


def test_error_info_fills_type_param_code_and_retry_after() -> None:
    info = common_pb2.ErrorInfo(
        type="invalid_request_error", param="messages[2].content", code="context_length_exceeded"
    )
    error = from_rpc_error(rpc_error(grpc.StatusCode.INVALID_ARGUMENT, "prompt too long", info), trace_id="t")
    assert error.body() == {
        "error": {
            "message": "prompt too long",
            "type": "invalid_request_error",
            "param": "messages[2].content",
            "code": "context_length_exceeded",
        }
    }
    busy = common_pb2.ErrorInfo(type="rate_limit_exceeded", retry_after_seconds=7)
    response = from_rpc_error(
        rpc_error(grpc.StatusCode.RESOURCE_EXHAUSTED, "saturated", busy), "t"
    ).response()
    assert (response.status_code, response.headers["retry-after"]) == (429, "7")


@pytest.mark.parametrize(
    "code", [grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN, grpc.StatusCode.DATA_LOSS]
)
def test_server_errors_hide_details(code: grpc.StatusCode) -> None:
    error = from_rpc_error(rpc_error(code, "KeyError: secret internal detail"), trace_id="abc123")
    assert error.status == 500
    assert "secret" not in error.message and "abc123" in error.message
    assert error.body()["error"]["type"] == "server_error"


@pytest.mark.parametrize(
    ("body", "param", "fragment"),
    [
        ({"messages": [{"role": "user", "content": "hi"}]}, "model", "Missing required parameter"),
        (CHAT | {"n": 17}, "n", "Invalid value"),
        (CHAT | {"logit_bias": {"1": 5}}, "logit_bias", "not supported"),
        (CHAT | {"chat_template_kwargs": {"x": [1]}}, "chat_template_kwargs.x", "Invalid value"),
        (CHAT | {"reasoning_effort": "extreme"}, "reasoning_effort", "Invalid value"),
        (CHAT | {"temperature": 3}, "temperature", "less than or equal to 2"),
        (
            {
                "model": "m",
                "messages": [
                    {"role": "user", "content": "a"},
                    {"role": "user", "content": "b"},
                    {"role": "user", "content": 5},
                ],
            },
            "messages[2].content",
            "Invalid value",
        ),
        (
            {"model": "m", "messages": [{"role": "robot", "content": "x"}]},
            "messages[0].role",
            "Invalid value",
        ),
        (CHAT | {"messages": []}, "messages", "at least 1"),
        (
            CHAT | {"response_format": {"type": "json_schema", "json_schema": {"name": "bad name!"}}},
            "response_format.json_schema.name",
            "Invalid value",
        ),
        (CHAT | {"top_logprobs": 2}, None, "top_logprobs requires logprobs"),
        (CHAT | {"cache_salt": ""}, "cache_salt", "at least 1"),
        (CHAT | {"cache_salt": "x" * 257}, "cache_salt", "at most 256"),
        (CHAT | {"prompt_cache_key": ""}, "prompt_cache_key", "at least 1"),
        (CHAT | {"prompt_cache_key": "k" * 257}, "prompt_cache_key", "at most 256"),
    ],
)
async def test_validation_errors_are_400_naming_the_field(
    body: dict, param: str | None, fragment: str
) -> None:
    async with serve_in_process(create_app(bridge_settings())) as client:
        response = await client.post("/v1/chat/completions", json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param
    assert fragment in error["message"]


@pytest.mark.parametrize("token", [-1, 2**32])
async def test_a_prompt_token_id_outside_uint32_is_400(token: int) -> None:
    # Found by the REST fuzzing (test_rest_fuzz.py): it used to fail the proto conversion, a 500.
    async with serve_in_process(create_app(bridge_settings())) as client:
        response = await client.post("/v1/completions", json={"model": "m", "prompt": [1, token]})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "prompt"


async def test_unparseable_json_is_400() -> None:
    async with serve_in_process(create_app(bridge_settings())) as client:
        response = await client.post(
            "/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"}
        )
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "invalid_json"


async def test_body_over_the_limit_is_413_declared_or_streamed() -> None:
    app = create_app(bridge_settings(max_body_bytes=2048))
    big = CHAT | {"messages": [{"role": "user", "content": "x" * 4096}]}
    async with serve_in_process(app) as client:
        declared = await client.post("/v1/chat/completions", json=big)

        async def chunks():
            # No Content-Length: the limit must hold while the body streams in.
            for _ in range(4):
                yield b" " * 1024

        streamed = await client.post(
            "/v1/chat/completions", content=chunks(), headers={"content-type": "application/json"}
        )
        small = await client.post("/v1/chat/completions", json=CHAT)
    for response in (declared, streamed):
        assert response.status_code == 413, response.text
        assert response.json()["error"]["code"] == "request_too_large"
    # Under the limit the request goes on to the (unreachable) router.
    assert small.status_code == 503


async def test_unreachable_router_is_503_with_retry_after() -> None:
    async with serve_in_process(create_app(bridge_settings())) as client:
        plain = await client.post("/v1/chat/completions", json=CHAT)
        # A stream refused before its first chunk gets a real status, not a 200 with an error inside.
        stream = await client.post("/v1/chat/completions", json=CHAT | {"stream": True})
        models = await client.get("/v1/models")
        health = await client.get("/health")
        ready = await client.get("/ready")
    for response in (plain, stream, models, health, ready):
        assert response.status_code == 503, response.text
        assert response.headers["retry-after"] == "1"
        assert response.headers["content-type"] == "application/json"
        assert response.json()["error"]["type"] == "service_unavailable"


async def test_unknown_route_and_method_are_openai_shaped() -> None:
    async with serve_in_process(create_app(bridge_settings())) as client:
        missing = await client.get("/v1/nothing")
        wrong_method = await client.get("/v1/chat/completions")
    assert missing.status_code == 404
    assert missing.json()["error"]["type"] == "not_found_error"
    assert wrong_method.status_code == 405
    assert set(wrong_method.json()["error"]) == {"message", "type", "param", "code"}


async def test_unexpected_exception_is_500_with_trace_id_and_no_internals() -> None:
    # The service's own logging (JSON lines) and tracing, as main() sets them up.
    configure_logging("bridge-tests")
    configure_tracing("bridge-tests")
    # Without its lifespan the app has no gRPC channels: a bug-shaped RuntimeError in a handler.
    app = create_app(bridge_settings())
    async with serve_in_process(app, lifespan=False) as client:
        response = await client.post("/v1/chat/completions", json=CHAT)
        # The server span continues the caller's W3C trace, so the id in the message is the caller's.
        traced = await client.post("/v1/chat/completions", json=CHAT, headers={"traceparent": TRACEPARENT})
    assert response.status_code == 500
    error = response.json()["error"]
    assert error["type"] == "server_error"
    assert "RuntimeError" not in error["message"] and "lifespan" not in error["message"]
    assert re.search(r"trace id [0-9a-f]{32}\)", error["message"]), error["message"]
    assert TRACE_ID in traced.json()["error"]["message"]


async def test_usage_query_validation() -> None:
    async with serve_in_process(create_app(bridge_settings())) as client:
        bad_group = await client.get("/v1/usage", params={"group_by": "model,planet"})
        bad_time = await client.get("/v1/usage", params={"start": "yesterday"})
    assert bad_group.status_code == 400 and bad_group.json()["error"]["param"] == "group_by"
    assert bad_time.status_code == 400 and bad_time.json()["error"]["param"] == "start"


async def test_workers_ai_validation() -> None:
    async with serve_in_process(create_app(bridge_settings())) as client:
        neither = await client.post("/ai/run/@cf/meta/m", json={"max_tokens": 5})
        batch_without_queue = await client.post("/ai/run/m", json={"requests": [{"prompt": "x"}]})
        queue_without_requests = await client.post("/ai/run/m?queueRequest=true", json={"prompt": "x"})
    assert (
        neither.status_code == 400
        and "exactly one of messages or prompt" in neither.json()["error"]["message"]
    )
    assert batch_without_queue.status_code == 400
    assert batch_without_queue.json()["error"]["param"] == "queueRequest"
    assert queue_without_requests.status_code == 400
    assert queue_without_requests.json()["error"]["param"] == "requests"
