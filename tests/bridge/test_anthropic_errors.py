"""Under /v1/messages every failure is Anthropic-shaped, with Anthropic's status; x-api-key authenticates.

The app runs in process with nothing behind it (the router's and tokenizer's
addresses are unreachable), so what reaches a backend answers 529 "overloaded".
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import grpc
import pytest

from cachet.bridge.app import create_app
from cachet.bridge.auth import Authenticator
from cachet.bridge.errors import from_rpc_error

from .conftest import NOWHERE, bridge_settings, serve_in_process
from .test_errors import rpc_error

MESSAGE = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
KEYS = {"sk-alpha": "acct-alpha"}


def anthropic_error(response, status: int, error_type: str) -> str:
    assert response.status_code == status, response.text
    body = response.json()
    assert body["type"] == "error"
    assert set(body["error"]) == {"type", "message"}
    assert body["error"]["type"] == error_type
    return body["error"]["message"]


@pytest.mark.parametrize(
    ("code", "status", "error_type"),
    [
        (grpc.StatusCode.INVALID_ARGUMENT, 400, "invalid_request_error"),
        (grpc.StatusCode.UNAUTHENTICATED, 401, "authentication_error"),
        (grpc.StatusCode.PERMISSION_DENIED, 403, "permission_error"),
        (grpc.StatusCode.NOT_FOUND, 404, "not_found_error"),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, 529, "overloaded_error"),
        (grpc.StatusCode.UNIMPLEMENTED, 400, "invalid_request_error"),
        (grpc.StatusCode.UNAVAILABLE, 529, "overloaded_error"),
        (grpc.StatusCode.INTERNAL, 500, "api_error"),
        (grpc.StatusCode.ALREADY_EXISTS, 409, "invalid_request_error"),
    ],
)
def test_status_table(code: grpc.StatusCode, status: int, error_type: str) -> None:
    error = from_rpc_error(rpc_error(code, "what went wrong"), trace_id="t")
    response = error.anthropic_response()
    assert response.status_code == status
    assert error.anthropic_body()["error"]["type"] == error_type
    # Retry-After still comes with what is worth retrying.
    assert (response.headers.get("retry-after") is not None) == (status == 529)


async def test_validation_and_unsupported_fields_are_400_naming_the_field() -> None:
    async with serve_in_process(create_app(bridge_settings())) as client:
        missing = await client.post(
            "/v1/messages", json={k: v for k, v in MESSAGE.items() if k != "max_tokens"}
        )
        # A thinking switch is checked against the model's template by the tokenizer
        # (tests/bridge/test_request_controls_end_to_end.py); a malformed one never leaves the bridge.
        thinking = await client.post("/v1/messages", json=MESSAGE | {"thinking": {"type": "sometimes"}})
        tool = await client.post(
            "/v1/messages", json=MESSAGE | {"tools": [{"type": "bash_20250124", "name": "bash"}]}
        )
        broken = await client.post(
            "/v1/messages", content=b'{"model": ', headers={"content-type": "application/json"}
        )
        count = await client.post("/v1/messages/count_tokens", json={"model": "m", "messages": []})
    assert "max_tokens" in anthropic_error(missing, 400, "invalid_request_error")
    assert "thinking" in anthropic_error(thinking, 400, "invalid_request_error")
    assert "server tool 'bash_20250124'" in anthropic_error(tool, 400, "invalid_request_error")
    assert "JSON" in anthropic_error(broken, 400, "invalid_request_error")
    assert "messages" in anthropic_error(count, 400, "invalid_request_error")


async def test_routing_and_size_errors_are_anthropic_shaped_too() -> None:
    async with serve_in_process(create_app(bridge_settings(max_body_bytes=2048))) as client:
        unknown = await client.post("/v1/messages/batches", json=MESSAGE)
        method = await client.get("/v1/messages")
        large = await client.post("/v1/messages", json=MESSAGE | {"system": "x" * 4096})
        # Elsewhere the same failures stay OpenAI's.
        openai = await client.get("/v1/chat/completions")
    anthropic_error(unknown, 404, "not_found_error")
    anthropic_error(method, 405, "invalid_request_error")
    anthropic_error(large, 413, "request_too_large")
    assert openai.status_code == 405
    assert set(openai.json()) == {"error"}


async def test_unreachable_backends_are_529_overloaded_with_retry_after() -> None:
    async with serve_in_process(create_app(bridge_settings(tokenizer_address=NOWHERE))) as client:
        plain = await client.post("/v1/messages", json=MESSAGE)
        streamed = await client.post("/v1/messages", json=MESSAGE | {"stream": True})
        count = await client.post(
            "/v1/messages/count_tokens", json={k: MESSAGE[k] for k in ("model", "messages")}
        )
    for response in (plain, streamed, count):
        anthropic_error(response, 529, "overloaded_error")
        assert response.headers["retry-after"] == "1"


async def test_x_api_key_authenticates_beside_bearer() -> None:
    async with serve_in_process(create_app(bridge_settings(api_keys=KEYS))) as client:
        missing = await client.post("/v1/messages", json=MESSAGE)
        wrong = await client.post("/v1/messages", json=MESSAGE, headers={"x-api-key": "sk-nope"})
        by_key = await client.post(
            "/v1/messages", json=MESSAGE, headers={"x-api-key": "sk-alpha", "anthropic-version": "2023-06-01"}
        )
        by_bearer = await client.post(
            "/v1/messages", json=MESSAGE, headers={"authorization": "Bearer sk-alpha"}
        )
        # Any route takes either header.
        openai = await client.get("/v1/models", headers={"x-api-key": "sk-alpha"})
    assert "x-api-key" in anthropic_error(missing, 401, "authentication_error")
    anthropic_error(wrong, 401, "authentication_error")
    # Past auth, to the unreachable router.
    for response in (by_key, by_bearer):
        anthropic_error(response, 529, "overloaded_error")
    assert openai.status_code == 503


def test_x_api_key_reaches_the_router_as_a_bearer() -> None:
    # The router reads keys from a bearer header only.
    assert Authenticator(KEYS).identify(None, None, "sk-alpha").metadata() == (
        ("x-cachet-account", "acct-alpha"),
        ("authorization", "Bearer sk-alpha"),
    )
    # The bearer wins when both come.
    assert Authenticator(KEYS).identify("Bearer sk-alpha", None, "sk-nope").account_id == "acct-alpha"


def mutations(node: object, path: tuple = ()) -> Iterator[tuple[tuple, object]]:
    """Every place in ``node`` with each wrong value put there, one at a time."""
    for wrong in (None, 0, -1, 2.5, "", "x", True, [], {}, [{}], {"type": "bogus"}):
        yield path, wrong
    children = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
    for key, child in children:
        yield from mutations(child, (*path, key))


def mutated(body: object, path: tuple, value: object) -> object:
    if not path:
        return value
    copy = json.loads(json.dumps(body))
    parent = copy
    for key in path[:-1]:
        parent = parent[key]
    parent[path[-1]] = value
    return copy


async def test_bad_input_is_an_anthropic_4xx_never_a_5xx() -> None:
    from .test_anthropic_convert import anthropic_request

    body = anthropic_request(stream=True, output_config={"format": {"type": "json_schema", "schema": {}}})
    seen = set()
    async with serve_in_process(create_app(bridge_settings(tokenizer_address=NOWHERE))) as client:
        for route in ("/v1/messages", "/v1/messages/count_tokens"):
            for path, value in mutations(body):
                response = await client.post(route, json=mutated(body, path, value))
                # 529: accepted, and on to the unreachable router or tokenizer.
                assert response.status_code in (400, 529), (route, path, value, response.text)
                assert response.json()["type"] == "error"
                seen.add(response.status_code)
    assert seen == {400, 529}
