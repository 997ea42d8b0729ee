"""Tool calling at the bridge's edges: Workers AI bodies to protos, calls back to Workers AI JSON."""

from __future__ import annotations

import pydantic
import pytest

from cachet.bridge import convert, schemas
from cachet.common.v1 import common_pb2
from cachet.router.v1 import router_pb2

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}


def workers_body(**fields: object) -> schemas.WorkersAIRunBody:
    return schemas.WorkersAIRunBody.model_validate({"prompt": "Weather in Oslo?"} | fields)


@pytest.mark.parametrize(
    ("choice", "expected"),
    [
        ("required", common_pb2.ToolChoice(mode=common_pb2.TOOL_CHOICE_MODE_REQUIRED)),
        ("none", common_pb2.ToolChoice(mode=common_pb2.TOOL_CHOICE_MODE_NONE)),
        (
            {"type": "function", "function": {"name": "weather"}},
            common_pb2.ToolChoice(function_name="weather"),
        ),
    ],
)
def test_workers_ai_tool_choice_reaches_the_router(choice: object, expected: common_pb2.ToolChoice) -> None:
    body = workers_body(tools=[{"name": "weather", "parameters": WEATHER}], tool_choice=choice)
    request = convert.workers_ai_request_to_proto("m", body)
    assert isinstance(request, router_pb2.ChatCompletionRequest)
    assert request.tool_choice == expected
    assert [tool.name for tool in request.tools] == ["weather"]
    assert not request.HasField("parallel_tool_calls")


def test_workers_ai_parallel_tool_calls_reach_the_router() -> None:
    body = workers_body(tools=[{"name": "weather"}], parallel_tool_calls=False)
    request = convert.workers_ai_request_to_proto("m", body)
    assert request.HasField("parallel_tool_calls") and not request.parallel_tool_calls
    assert not request.HasField("tool_choice")


@pytest.mark.parametrize(
    "fields",
    [
        {"tools": [{"name": "time"}], "tool_choice": {"type": "function", "function": {"name": "weather"}}},
        {"tool_choice": "required", "raw": True},
        {"tools": [{"name": "time"}], "raw": True},
    ],
)
def test_workers_ai_tool_fields_that_cannot_apply(fields: dict) -> None:
    with pytest.raises(pydantic.ValidationError):
        workers_body(**fields)


def test_workers_ai_calls_carry_arguments_as_objects() -> None:
    completion = router_pb2.ChatCompletion(
        tool_calls=[
            common_pb2.ToolCall(id="a", name="weather", arguments_json='{"city": "Oslo"}'),
            # Cut short by max_tokens: not an object, so the text as written.
            common_pb2.ToolCall(id="b", name="weather", arguments_json='{"city": "Be'),
        ]
    )
    out = convert.workers_ai_result_to_json(completion)
    assert out["result"]["tool_calls"] == [
        {"name": "weather", "arguments": {"city": "Oslo"}},
        {"name": "weather", "arguments": '{"city": "Be'},
    ]
    schemas.WorkersAIResponse.model_validate(out)


def test_workers_ai_stream_fragments_join_by_index() -> None:
    chunk = router_pb2.ChatCompletionChunk(
        tool_call_deltas=[
            router_pb2.ToolCallDelta(index=0, id="call_1", name="weather", arguments_delta=""),
            router_pb2.ToolCallDelta(index=0, arguments_delta='{"city": "Oslo"}'),
        ]
    )
    (event,) = convert.workers_ai_chunk_to_json(chunk)
    assert event["tool_calls"] == [
        {"index": 0, "name": "weather", "arguments": ""},
        {"index": 0, "name": "", "arguments": '{"city": "Oslo"}'},
    ]
    schemas.WorkersAIStreamEvent.model_validate(event)


def test_chat_stream_sends_text_then_one_tool_delta_per_event() -> None:
    chunk = router_pb2.ChatCompletionChunk(
        id="c",
        model="m",
        content_delta="Checking.",
        finish_reason=common_pb2.FINISH_REASON_TOOL_CALLS,
        tool_call_deltas=[
            router_pb2.ToolCallDelta(index=0, id="call_1", name="weather", arguments_delta=""),
            router_pb2.ToolCallDelta(index=0, arguments_delta="{}"),
        ],
    )
    events = convert.chat_chunk_to_json(chunk, include_usage=False)
    assert [event["choices"][0]["delta"] for event in events] == [
        {"content": "Checking."},
        {
            "tool_calls": [
                {
                    "index": 0,
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "weather", "arguments": ""},
                }
            ]
        },
        {"tool_calls": [{"index": 0, "function": {"arguments": "{}"}}]},
    ]
    assert [event["choices"][0]["finish_reason"] for event in events] == [None, None, "tool_calls"]
    for event in events:
        schemas.ChatCompletionChunkResponse.model_validate(event)
