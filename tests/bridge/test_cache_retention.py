"""Cache retention at the bridge: OpenAI's prompt_cache_retention and Anthropic's cache_control
as the router's typed fields; bad values refused with each API's 400 naming the field.

The app runs in process with nothing behind it: a refused body never leaves the bridge."""

from __future__ import annotations

from typing import Any

import pytest

from cachet.bridge import anthropic_convert, convert, responses_convert, schemas
from cachet.bridge import anthropic_schemas as anthropic
from cachet.bridge import responses_schemas as responses
from cachet.bridge.app import create_app
from cachet.router.v1 import router_pb2

from .conftest import bridge_settings, serve_in_process
from .test_anthropic_errors import anthropic_error

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
MESSAGE = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
EPHEMERAL = {"type": "ephemeral"}
HOUR = {"type": "ephemeral", "ttl": "1h"}


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/chat/completions", CHAT | {"prompt_cache_retention": "forever"}),
        ("/v1/completions", {"model": "m", "prompt": "hi", "prompt_cache_retention": "1h"}),
        ("/v1/responses", {"model": "m", "input": "hi", "prompt_cache_retention": 24}),
    ],
)
async def test_an_unknown_prompt_cache_retention_is_openais_400_naming_the_field(
    path: str, body: dict
) -> None:
    async with serve_in_process(create_app(bridge_settings())) as client:
        response = await client.post(path, json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["type"], error["param"], error["code"]) == (
        "invalid_request_error",
        "prompt_cache_retention",
        "invalid_value",
    )
    assert "'in_memory', '24h' or 'none'" in error["message"]


@pytest.mark.parametrize(
    ("body", "fragment"),
    [
        (MESSAGE | {"cache_control": {"type": "ephemeral", "ttl": "24h"}}, "cache_control.ttl"),
        (MESSAGE | {"cache_control": {"type": "persistent"}}, "cache_control.type"),
        (MESSAGE | {"cache_control": {"ttl": "5m"}}, "cache_control.type"),
        (
            MESSAGE
            | {
                "tools": [
                    {"name": "read", "input_schema": {}, "cache_control": {"type": "ephemeral", "ttl": "2h"}}
                ]
            },
            "tools[0].cache_control.ttl",
        ),
        (
            MESSAGE
            | {
                "system": [
                    {"type": "text", "text": f"part {i}", "cache_control": EPHEMERAL} for i in range(4)
                ],
                "cache_control": EPHEMERAL,
            },
            "A maximum of 4 blocks with cache_control may be provided. Found 5.",
        ),
    ],
)
async def test_a_bad_cache_control_is_anthropics_400_naming_the_field(body: dict, fragment: str) -> None:
    async with serve_in_process(create_app(bridge_settings())) as client:
        response = await client.post("/v1/messages", json=body)
    assert fragment in anthropic_error(response, 400, "invalid_request_error")


@pytest.mark.parametrize(
    ("value", "retention"),
    [
        (None, router_pb2.CACHE_RETENTION_UNSPECIFIED),
        ("in_memory", router_pb2.CACHE_RETENTION_IN_MEMORY),
        ("24h", router_pb2.CACHE_RETENTION_24H),
        ("none", router_pb2.CACHE_RETENTION_NONE),
    ],
)
def test_prompt_cache_retention_is_the_routers_cache_retention(value: str | None, retention: int) -> None:
    extra = {} if value is None else {"prompt_cache_retention": value}
    chat = convert.chat_request_to_proto(schemas.ChatCompletionBody(**CHAT, **extra))
    text = convert.completion_request_to_proto(schemas.CompletionBody(model="m", prompt="hi", **extra))
    body = responses.ResponsesBody(model="m", input="hi", **extra)
    response = responses_convert.responses_request_to_proto(
        body, responses_convert.input_items(body), "resp_1", ""
    )
    assert chat.cache_retention == text.cache_retention == response.cache_retention == retention


def text(content: str, control: dict | None = None) -> dict[str, Any]:
    block: dict[str, Any] = {"type": "text", "text": content}
    return block | ({"cache_control": control} if control else {})


def test_cache_control_breakpoints_end_after_the_chat_messages_holding_them() -> None:
    body = anthropic.MessagesBody(
        model="m",
        max_tokens=8,
        tools=[{"name": "read", "input_schema": {"type": "object"}, "cache_control": HOUR}],
        system=[text("You are terse."), text("Project notes.", HOUR)],
        messages=[
            {"role": "user", "content": "Read a.txt"},
            {
                "role": "assistant",
                "content": [{"type": "tool_use", "id": "t1", "name": "read", "input": {"path": "a.txt"}}],
            },
            # One turn, three chat messages: tool (t1), user (the text), tool (t2).
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "t1", "content": [text("A", EPHEMERAL)]},
                    text("and b?", EPHEMERAL),
                    {"type": "tool_result", "tool_use_id": "t2", "content": "B"},
                ],
            },
        ],
    )
    request = anthropic_convert.messages_request_to_proto(body)
    assert [m.role for m in request.messages] == ["system", "user", "assistant", "tool", "user", "tool"]
    assert [(b.messages, b.retention) for b in request.cache_breakpoints] == [
        (0, router_pb2.CACHE_RETENTION_1H),  # the tools alone
        (1, router_pb2.CACHE_RETENTION_1H),  # through the system prompt
        (4, router_pb2.CACHE_RETENTION_5M),  # through t1's tool message
        (5, router_pb2.CACHE_RETENTION_5M),  # through the user message after it
    ]
    assert request.cache_retention == router_pb2.CACHE_RETENTION_UNSPECIFIED


@pytest.mark.parametrize(
    ("control", "retention"),
    [
        (None, router_pb2.CACHE_RETENTION_UNSPECIFIED),
        (EPHEMERAL, router_pb2.CACHE_RETENTION_5M),
        (HOUR, router_pb2.CACHE_RETENTION_1H),
    ],
)
def test_a_top_level_cache_control_keeps_the_whole_prompt(control: dict | None, retention: int) -> None:
    body = anthropic.MessagesBody(**MESSAGE, **({"cache_control": control} if control else {}))
    request = anthropic_convert.messages_request_to_proto(body)
    assert request.cache_retention == retention
    assert list(request.cache_breakpoints) == []
