"""Anthropic Messages <-> router protos: the same router request as the chat path, and Anthropic's answers.

No services: requests are compared with what ``/v1/chat/completions`` sends for
the same conversation, and answers and streams are checked against the response
models (which forbid extra fields) and against each other.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from pydantic import ValidationError

from cachet.bridge import anthropic_convert, convert, schemas
from cachet.bridge.anthropic_schemas import (
    CountTokensBody,
    MessageResponse,
    MessagesBody,
    MessageStreamEventOut,
)
from cachet.bridge.anthropic_stream import MessageStream
from cachet.bridge.calls import ANTHROPIC_SSE
from cachet.bridge.errors import BridgeError
from cachet.common.v1 import common_pb2
from cachet.router.v1 import router_pb2

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
PNG = "iVBORw0KGgo="


def anthropic_request(**overrides: Any) -> dict[str, Any]:
    body = {
        "model": "m",
        "max_tokens": 32,
        "system": [{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}],
        "messages": [
            {"role": "user", "content": "Weather in Paris?"},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "I should call the tool.", "signature": ""},
                    {"type": "text", "text": "Let me look."},
                    {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"},
                    {
                        "type": "tool_result",
                        "tool_use_id": "toolu_1",
                        "content": [{"type": "text", "text": "22C"}],
                        "is_error": False,
                    },
                    {"type": "text", "text": "And this picture?", "cache_control": {"type": "ephemeral"}},
                    {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": PNG}},
                ],
            },
        ],
        "tools": [
            {
                "name": "get_weather",
                "description": "Weather.",
                "input_schema": WEATHER,
                "cache_control": {"type": "ephemeral", "ttl": "1h"},
            }
        ],
        "tool_choice": {"type": "auto", "disable_parallel_tool_use": True},
        "stop_sequences": ["\n\nHuman:"],
        "temperature": 0.5,
        "top_p": 0.9,
        "top_k": 40,
        "metadata": {"user_id": "u-1"},
    }
    return body | overrides


def the_same_as_openai() -> dict[str, Any]:
    call = {
        "id": "toolu_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
    }
    return {
        "model": "m",
        "max_tokens": 32,
        "messages": [
            {"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
            {"role": "user", "content": "Weather in Paris?"},
            {
                "role": "assistant",
                "content": [{"type": "text", "text": "Let me look."}],
                "tool_calls": [call],
                "reasoning_content": "I should call the tool.",
            },
            {"role": "tool", "tool_call_id": "toolu_1", "content": "sunny"},
            {"role": "tool", "tool_call_id": "toolu_1", "content": [{"type": "text", "text": "22C"}]},
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "And this picture?"},
                    {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{PNG}"}},
                ],
            },
        ],
        "tools": [
            {
                "type": "function",
                "function": {"name": "get_weather", "description": "Weather.", "parameters": WEATHER},
            }
        ],
        "tool_choice": "auto",
        "parallel_tool_calls": False,
        "stop": ["\n\nHuman:"],
        "temperature": 0.5,
        "top_p": 0.9,
        "top_k": 40,
    }


def test_a_message_is_the_router_request_the_chat_path_sends() -> None:
    anthropic = anthropic_convert.messages_request_to_proto(MessagesBody(**anthropic_request()))
    openai = convert.chat_request_to_proto(schemas.ChatCompletionBody(**the_same_as_openai()))
    assert anthropic.request_id.startswith("msg_")
    anthropic.ClearField("request_id")
    # Its cache_control blocks, which OpenAI's body has no way to say (test_cache_retention.py):
    # the tool, the system prompt, and the text after two tool results.
    assert [(b.messages, b.retention) for b in anthropic.cache_breakpoints] == [
        (0, router_pb2.CACHE_RETENTION_1H),
        (1, router_pb2.CACHE_RETENTION_5M),
        (6, router_pb2.CACHE_RETENTION_5M),
    ]
    anthropic.ClearField("cache_breakpoints")
    assert anthropic == openai


@pytest.mark.parametrize(
    ("choice", "expected"),
    [
        ({"type": "auto"}, common_pb2.ToolChoice(mode=common_pb2.TOOL_CHOICE_MODE_AUTO)),
        ({"type": "any"}, common_pb2.ToolChoice(mode=common_pb2.TOOL_CHOICE_MODE_REQUIRED)),
        ({"type": "none"}, common_pb2.ToolChoice(mode=common_pb2.TOOL_CHOICE_MODE_NONE)),
        ({"type": "tool", "name": "get_weather"}, common_pb2.ToolChoice(function_name="get_weather")),
    ],
)
def test_tool_choices(choice: dict, expected: common_pb2.ToolChoice) -> None:
    request = anthropic_convert.messages_request_to_proto(
        MessagesBody(**anthropic_request(tool_choice=choice))
    )
    assert request.tool_choice == expected
    # Parallel calls stay the default unless the client disables them.
    assert not request.HasField("parallel_tool_calls")


def test_plain_strings_url_images_and_structured_output() -> None:
    body = MessagesBody(
        model="m",
        max_tokens=8,
        system="Be brief.",
        messages=[
            {
                "role": "user",
                "content": [{"type": "image", "source": {"type": "url", "url": "https://x.test/a.png"}}],
            }
        ],
        output_config={"format": {"type": "json_schema", "schema": WEATHER}},
    )
    request = anthropic_convert.messages_request_to_proto(body)
    assert [m.role for m in request.messages] == ["system", "user"]
    assert request.messages[0].content[0].text == "Be brief."
    assert request.messages[1].content[0].image_url == "https://x.test/a.png"
    assert json.loads(request.response_format.json_schema.schema_json) == WEATHER
    # A tool with a null (or no) description.
    tools = [{"name": "f", "description": None, "input_schema": {"type": "object"}}]
    described = anthropic_convert.messages_request_to_proto(
        MessagesBody(**anthropic_request(tools=tools, tool_choice=None))
    )
    assert described.tools[0].description == ""
    assert request.response_format.json_schema.strict
    # Unset sampling stays unset: the router's defaults apply.
    assert not request.sampling.HasField("temperature")
    assert request.sampling.max_tokens == 8


def test_count_tokens_renders_the_prompt_the_router_would() -> None:
    body = anthropic_request()
    for key in ("max_tokens", "stop_sequences", "temperature", "top_p", "top_k", "metadata"):
        body.pop(key)
    template = anthropic_convert.count_tokens_request_to_proto(CountTokensBody(**body))
    chat = anthropic_convert.messages_request_to_proto(MessagesBody(**anthropic_request()))
    assert template.add_generation_prompt
    # Only the count comes back: the images' pixels stay in the tokenizer.
    assert template.count_only
    assert list(template.messages) == list(chat.messages)
    assert list(template.tools) == list(chat.tools)
    # tool_choice none: the router offers no tools, so they are not counted.
    none = CountTokensBody(**body | {"tool_choice": {"type": "none"}})
    assert not anthropic_convert.count_tokens_request_to_proto(none).tools


@pytest.mark.parametrize(
    ("change", "words"),
    [
        ({"max_tokens": None}, "max_tokens"),
        ({"max_tokens": 0}, "greater than or equal to 1"),
        ({"temperature": 1.5}, "less than or equal to 1"),
        ({"thinking": {"type": "sometimes"}}, "'enabled'"),
        ({"output_config": {"effort": "max"}}, "'low'"),
        ({"container": "c-1"}, "not supported"),
        ({"mcp_servers": [{"type": "url", "url": "https://x.test", "name": "x"}]}, "not supported"),
        ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "server tool"),
        ({"tools": [{"name": "bad name", "input_schema": {}}]}, "pattern"),
        ({"tool_choice": {"type": "tool", "name": "nope"}}, "not in tools"),
        ({"tool_choice": {"type": "sometimes"}}, "does not match any of the expected tags"),
        (
            {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Sure"}]},
            "prefill",
        ),
        ({"messages": [{"role": "user", "content": []}]}, "at least 1 item"),
        ({"messages": [{"role": "system", "content": "hi"}]}, "'user' or 'assistant'"),
        ({"messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]}, "'document'"),
        (
            {"messages": [{"role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "t"}]}]},
            "cannot carry tool_result",
        ),
        (
            {
                "messages": [
                    {"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]}
                ]
            },
            "cannot carry tool_use",
        ),
        ({"stop_sequences": [""]}, "at least 1 character"),
    ],
)
def test_refused_requests_say_why(change: dict, words: str) -> None:
    body = {key: value for key, value in (anthropic_request() | change).items() if value is not None}
    with pytest.raises(ValidationError, match=words):
        MessagesBody(**body)


def test_fields_that_change_nothing_are_accepted_and_unknown_ones_kept_for_the_log() -> None:
    body = MessagesBody(
        **anthropic_request(
            thinking={"type": "disabled"},
            service_tier="auto",
            cache_control={"type": "ephemeral"},
            brand_new_field=1,
        )
    )
    assert body.model_extra == {"brand_new_field": 1}


def completion(**fields: Any) -> router_pb2.ChatCompletion:
    usage = common_pb2.Usage(prompt_tokens=100, cached_tokens=64, completion_tokens=7)
    return router_pb2.ChatCompletion(id="msg_1", model="m", created=1, usage=usage, **fields)


def test_whole_answer_blocks_stop_reasons_and_usage() -> None:
    calls = [
        common_pb2.ToolCall(id="call_1", name="get_weather", arguments_json='{"city": "Paris"}'),
        common_pb2.ToolCall(id="call_2", name="get_weather", arguments_json='{"city": "Par'),
    ]
    answer = anthropic_convert.message_to_json(
        completion(
            reasoning_content="hmm",
            content="Looking.",
            tool_calls=calls,
            finish_reason=common_pb2.FINISH_REASON_TOOL_CALLS,
        )
    )
    MessageResponse.model_validate(answer)
    assert answer["content"] == [
        {"type": "thinking", "thinking": "hmm", "signature": ""},
        {"type": "text", "text": "Looking."},
        {"type": "tool_use", "id": "call_1", "name": "get_weather", "input": {"city": "Paris"}},
        # Cut short: its text is no object.
        {"type": "tool_use", "id": "call_2", "name": "get_weather", "input": {}},
    ]
    assert answer["stop_reason"] == "tool_use"
    assert answer["stop_sequence"] is None
    # Anthropic's split: input_tokens leaves out the cached ones.
    assert answer["usage"] == {
        "input_tokens": 36,
        "cache_read_input_tokens": 64,
        "cache_creation_input_tokens": 0,
        "output_tokens": 7,
    }
    for finish, reason in (
        (common_pb2.FINISH_REASON_STOP, "end_turn"),
        (common_pb2.FINISH_REASON_LENGTH, "max_tokens"),
    ):
        plain = anthropic_convert.message_to_json(completion(content="x", finish_reason=finish))
        assert plain["stop_reason"] == reason
        assert plain["content"] == [{"type": "text", "text": "x"}]


def chunks() -> list[router_pb2.ChatCompletionChunk]:
    head = {"id": "msg_1", "model": "m", "created": 1}
    delta = router_pb2.ToolCallDelta
    return [
        router_pb2.ChatCompletionChunk(**head, role="assistant"),
        router_pb2.ChatCompletionChunk(**head, reasoning_delta="hm"),
        router_pb2.ChatCompletionChunk(**head, reasoning_delta="m"),
        router_pb2.ChatCompletionChunk(**head, content_delta="Look"),
        router_pb2.ChatCompletionChunk(**head, content_delta="ing."),
        router_pb2.ChatCompletionChunk(
            **head,
            tool_call_deltas=[
                delta(index=0, id="call_1", name="get_weather", arguments_delta=""),
                delta(index=0, arguments_delta='{"city": '),
            ],
        ),
        router_pb2.ChatCompletionChunk(
            **head,
            tool_call_deltas=[
                delta(index=0, arguments_delta='"Paris"}'),
                delta(index=1, id="call_2", name="get_time", arguments_delta="{}"),
            ],
        ),
        router_pb2.ChatCompletionChunk(
            **head,
            finish_reason=common_pb2.FINISH_REASON_TOOL_CALLS,
            usage=common_pb2.Usage(prompt_tokens=100, cached_tokens=64, completion_tokens=7),
        ),
    ]


def accumulate(events: list[dict]) -> dict:
    """The message the events add up to, as Anthropic's SDKs build it."""
    message: dict = {}
    partial: dict[int, str] = {}
    for event in events:
        kind = event["type"]
        if kind == "message_start":
            message = json.loads(json.dumps(event["message"]))
        elif kind == "content_block_start":
            assert event["index"] == len(message["content"])
            message["content"].append(dict(event["content_block"]))
        elif kind == "content_block_delta":
            block, delta = message["content"][event["index"]], event["delta"]
            if delta["type"] == "text_delta":
                block["text"] += delta["text"]
            elif delta["type"] == "thinking_delta":
                block["thinking"] += delta["thinking"]
            else:
                partial[event["index"]] = partial.get(event["index"], "") + delta["partial_json"]
        elif kind == "content_block_stop":
            if event["index"] in partial:
                message["content"][event["index"]]["input"] = json.loads(partial[event["index"]])
        elif kind == "message_delta":
            message |= event["delta"]
            message["usage"] = event["usage"]
    return message


def test_stream_events_are_typed_ordered_and_add_up_to_the_whole_answer() -> None:
    render = MessageStream()
    events = [event for chunk in chunks() for event in render(chunk)]
    for event in events:
        MessageStreamEventOut.model_validate(event)
    kinds = [event["type"] for event in events]
    assert kinds[:2] == ["message_start", "ping"]
    assert kinds[-2:] == ["message_delta", "message_stop"]
    # Each block opened once, closed once, before the next opens.
    opened = [e["index"] for e in events if e["type"] == "content_block_start"]
    closed = [e["index"] for e in events if e["type"] == "content_block_stop"]
    assert opened == closed == [0, 1, 2, 3]
    whole = router_pb2.ChatCompletion(
        id="msg_1",
        model="m",
        reasoning_content="hmm",
        content="Looking.",
        tool_calls=[
            common_pb2.ToolCall(id="call_1", name="get_weather", arguments_json='{"city": "Paris"}'),
            common_pb2.ToolCall(id="call_2", name="get_time", arguments_json="{}"),
        ],
        finish_reason=common_pb2.FINISH_REASON_TOOL_CALLS,
        usage=common_pb2.Usage(prompt_tokens=100, cached_tokens=64, completion_tokens=7),
    )
    assert accumulate(events) == anthropic_convert.message_to_json(whole)


def test_a_stream_with_no_text_still_starts_and_ends_the_message() -> None:
    render = MessageStream()
    first = router_pb2.ChatCompletionChunk(id="msg_1", model="m", role="assistant")
    last = router_pb2.ChatCompletionChunk(
        id="msg_1", model="m", finish_reason=common_pb2.FINISH_REASON_LENGTH, usage=common_pb2.Usage()
    )
    events = render(first) + render(last)
    assert [e["type"] for e in events] == ["message_start", "ping", "message_delta", "message_stop"]
    assert events[2]["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}


def test_sse_framing_is_anthropic_s() -> None:
    assert ANTHROPIC_SSE.event({"type": "ping"}) == b'event: ping\ndata: {"type":"ping"}\n\n'
    failure = ANTHROPIC_SSE.error(BridgeError(429, "over capacity"))
    assert failure == (
        b'event: error\ndata: {"type":"error","error":{"type":"overloaded_error","message":"over capacity"}}\n\n'
    )
    assert ANTHROPIC_SSE.end == b""
