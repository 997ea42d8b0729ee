"""API keys and development mode; SSE framing; and an /openapi.json that says what the bridge does."""

from __future__ import annotations

from typing import Any

import pytest

from cachet.bridge.app import create_app
from cachet.bridge.auth import Authenticator, Caller
from cachet.bridge.calls import DONE, sse_event
from cachet.bridge.errors import BridgeError
from cachet.tls import TlsSettings

from .conftest import bridge_settings, serve_in_process

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
KEYS = {"sk-alpha": "acct-alpha", "sk-beta": "acct-beta"}


async def test_keys_configured_unknown_or_missing_key_is_401() -> None:
    async with serve_in_process(create_app(bridge_settings(api_keys=KEYS))) as client:
        missing = await client.post("/v1/chat/completions", json=CHAT)
        unknown = await client.post(
            "/v1/chat/completions", json=CHAT, headers={"Authorization": "Bearer sk-nope"}
        )
        basic = await client.get("/v1/models", headers={"Authorization": "Basic c2stYWxwaGE="})
        # Auth comes before validation, as OpenAI's does: a bad body from a stranger is still 401.
        invalid = await client.post("/v1/chat/completions", json={"model": "m"})
        known = await client.post(
            "/v1/chat/completions", json=CHAT, headers={"Authorization": "Bearer sk-alpha"}
        )
    for response in (missing, unknown, basic, invalid):
        assert response.status_code == 401, response.text
        assert response.json()["error"]["type"] == "authentication_error"
        assert response.json()["error"]["code"] == "invalid_api_key"
    # A known key gets past auth, to the (unreachable) router.
    assert known.status_code == 503


async def test_account_path_must_match_the_key() -> None:
    body = {"prompt": "hi"}
    async with serve_in_process(create_app(bridge_settings(api_keys=KEYS))) as client:
        headers = {"Authorization": "Bearer sk-alpha"}
        other = await client.post("/client/v4/accounts/acct-beta/ai/run/@cf/m", json=body, headers=headers)
        own = await client.post("/client/v4/accounts/acct-alpha/ai/run/@cf/m", json=body, headers=headers)
    assert other.status_code == 403
    assert other.json()["error"] == {
        "message": "This API key does not belong to that account.",
        "type": "permission_error",
        "param": "account_id",
        "code": None,
    }
    assert own.status_code == 503


async def test_dev_mode_accepts_anyone_as_anonymous_on_loopback_only() -> None:
    async with serve_in_process(create_app(bridge_settings())) as client:
        anything = await client.post(
            "/v1/chat/completions", json=CHAT, headers={"Authorization": "Bearer whatever"}
        )
        nothing = await client.post("/v1/chat/completions", json=CHAT)
    assert anything.status_code == nothing.status_code == 503
    # Plaintext allowed, so that only the missing keys can refuse (TLS: tests/bridge/test_tls.py).
    plaintext = TlsSettings(allow_plaintext=True)
    for host in ("0.0.0.0", "10.1.2.3", "example.com"):
        with pytest.raises(ValueError, match="no API keys configured"):
            create_app(bridge_settings(host=host, tls=plaintext))
    for host in ("127.0.0.1", "::1", "localhost"):
        create_app(bridge_settings(host=host))
    # With keys, any host is fine.
    create_app(bridge_settings(host="0.0.0.0", api_keys=KEYS, tls=plaintext))


def test_caller_identity_and_metadata() -> None:
    auth = Authenticator(KEYS)
    caller = auth.identify("Bearer sk-beta", "session-42")
    assert caller == Caller("acct-beta", "Bearer sk-beta", "session-42")
    assert caller.metadata() == (
        ("x-cachet-account", "acct-beta"),
        ("authorization", "Bearer sk-beta"),
        ("x-session-affinity", "session-42"),
    )
    assert Authenticator({}).identify(None, None).metadata() == (("x-cachet-account", "anonymous"),)
    with pytest.raises(BridgeError) as bad_session:
        auth.identify("Bearer sk-beta", "caf\u00e9")
    assert (bad_session.value.status, bad_session.value.param) == (400, "x-session-affinity")
    with pytest.raises(BridgeError) as empty_key:
        auth.identify("Bearer ", None)
    assert empty_key.value.status == 401


def test_sse_framing_is_openai_s() -> None:
    assert sse_event({"a": "é", "b": [1, None]}) == 'data: {"a":"é","b":[1,null]}\n\n'.encode()
    assert DONE == b"data: [DONE]\n\n"


def _refs(node: Any) -> list[str]:
    if isinstance(node, dict):
        found = [node["$ref"]] if isinstance(node.get("$ref"), str) else []
        return found + [ref for value in node.values() for ref in _refs(value)]
    if isinstance(node, list):
        return [ref for value in node for ref in _refs(value)]
    return []


async def test_openapi_declares_models_errors_and_streams() -> None:
    async with serve_in_process(create_app(bridge_settings())) as client:
        spec = (await client.get("/openapi.json")).json()
    paths = spec["paths"]
    assert set(paths) == {
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/models",
        "/ai/run/{model}",
        "/client/v4/accounts/{account_id}/ai/run/{model}",
        "/v1/usage",
        "/health",
        "/ready",
        "/metrics",
        "/v1/files",
        "/v1/files/{file_id}",
        "/v1/files/{file_id}/content",
        "/v1/batches",
        "/v1/batches/{batch_id}",
        "/v1/batches/{batch_id}/cancel",
        "/v1/batches/{batch_id}/webhook_attempts",
        "/v1/messages",
        "/v1/messages/count_tokens",
        "/v1/responses",
        "/v1/responses/{response_id}",
        "/v1/responses/{response_id}/input_items",
    }
    chat = paths["/v1/chat/completions"]["post"]
    ok = chat["responses"]["200"]["content"]
    assert ok["application/json"]["schema"]["$ref"] == "#/components/schemas/ChatCompletionResponse"
    assert ok["text/event-stream"]["schema"]["$ref"] == "#/components/schemas/ChatCompletionChunkResponse"
    assert chat["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith(
        "/ChatCompletionBody"
    )
    for path, methods in paths.items():
        anthropic = path.startswith("/v1/messages")
        for operation in methods.values():
            responses = operation["responses"]
            # Validation answers 400 with the error shape: FastAPI's 422 must not be advertised.
            assert "422" not in responses
            shape = "AnthropicErrorResponse" if anthropic else "ErrorResponse"
            assert (
                responses["400"]["content"]["application/json"]["schema"]["$ref"]
                == f"#/components/schemas/{shape}"
            )
            # Anthropic's "overloaded" is 529 where OpenAI's clients get 503.
            assert ("529" if anthropic else "503") in responses
    messages = paths["/v1/messages"]["post"]["responses"]["200"]["content"]
    assert messages["application/json"]["schema"]["$ref"] == "#/components/schemas/MessageResponse"
    assert messages["text/event-stream"]["schema"]["$ref"] == "#/components/schemas/MessageStreamEventOut"
    created = paths["/v1/responses"]["post"]["responses"]["200"]["content"]
    assert created["application/json"]["schema"]["$ref"] == "#/components/schemas/ResponseObject"
    assert created["text/event-stream"]["schema"]["$ref"] == "#/components/schemas/ResponseStreamEventOut"
    # Every reference resolves: the SSE event models are in the components too.
    components = spec["components"]["schemas"]
    for ref in _refs(spec):
        assert ref.removeprefix("#/components/schemas/") in components, ref
    assert spec["components"]["securitySchemes"]["HTTPBearer"]["scheme"] == "bearer"
    assert spec["components"]["securitySchemes"]["APIKeyHeader"]["name"] == "x-api-key"
    # The cached-token count is part of the declared usage, required.
    assert "cached_tokens" in components["PromptTokensDetails"]["required"]


async def test_metrics_count_requests_by_route_template() -> None:
    async with serve_in_process(create_app(bridge_settings())) as client:
        await client.post("/ai/run/@cf/meta/llama", json={"prompt": "x"})
        await client.post("/ai/run/@cf/other", json={"prompt": "x"})
        text = (await client.get("/metrics")).text
    # One series per route, not per model: the template is the label.
    assert 'cachet_bridge_requests_total{method="POST",route="/ai/run/{model:path}",status="503"} 2.0' in text
    assert "cachet_bridge_request_duration_seconds_bucket" in text
