"""The Responses API's conversion, stream rendering, store and refusals, in process (no services).

The conversation's items must reach the router as the very chat request the chat
path would send; a streamed response must add up, event by event, to the whole
one; and every bad request is a 400 (or 404) in OpenAI's shape before any gRPC hop.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from cachet.bridge import convert, responses_convert, schemas
from cachet.bridge.calls import SSEDialect
from cachet.bridge.errors import BridgeError
from cachet.bridge.responses_routes import _stored_first
from cachet.bridge.responses_schemas import ResponseObject, ResponsesBody
from cachet.bridge.responses_stream import ResponseStream
from cachet.common.v1 import common_pb2
from cachet.router.v1 import router_pb2

TOOL = {"type": "function", "name": "get_weather", "parameters": {"type": "object"}}


def body(**fields: object) -> ResponsesBody:
    return ResponsesBody(**({"model": "m", "input": "Hi"} | fields))


def test_items_become_the_chat_request_the_chat_path_sends() -> None:
    items = [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "input_text", "text": "Weather?"}]},
        {
            "type": "reasoning",
            "id": "rs_1",
            "summary": [],
            "content": [{"type": "reasoning_text", "text": "t"}],
        },
        {
            "type": "message",
            "role": "assistant",
            "content": [{"type": "output_text", "text": "Let me look."}],
        },
        {
            "type": "function_call",
            "call_id": "call_1",
            "name": "get_weather",
            "arguments": '{"city":"Paris"}',
        },
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
    ]
    request = body(input=items, instructions="You are terse.", tools=[TOOL], max_output_tokens=7, top_p=0.5)
    message = responses_convert.responses_request_to_proto(
        request, responses_convert.input_items(request), "resp_1", "s1"
    )
    chat = schemas.ChatCompletionBody(
        model="m",
        max_tokens=7,
        top_p=0.5,
        tools=[{"function": {"name": "get_weather", "parameters": {"type": "object"}, "strict": True}}],
        messages=[
            {"role": "system", "content": "You are terse."},
            {"role": "developer", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "Weather?"}]},
            {
                "role": "assistant",
                "content": [{"type": "text", "text": "Let me look."}],
                "reasoning_content": "t",
                "tool_calls": [
                    {"id": "call_1", "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}}
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        ],
    )
    expected = convert.chat_request_to_proto(chat)
    expected.request_id, expected.session_id = "resp_1", "s1"
    assert message == expected


def test_an_assistant_item_of_plain_text_is_one_text_part() -> None:
    # An easy input message may carry a string as its content; it once went in character by
    # character, which the chat schema refused.
    request = body(input=[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello"}])
    message = responses_convert.responses_request_to_proto(
        request, responses_convert.input_items(request), "resp_1", "s1"
    )
    chat = schemas.ChatCompletionBody(
        model="m",
        messages=[
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": [{"type": "text", "text": "Hello"}]},
        ],
    )
    expected = convert.chat_request_to_proto(chat)
    expected.request_id, expected.session_id = "resp_1", "s1"
    assert message == expected


def test_text_format_and_tool_choice_take_the_chat_path() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    request = body(
        text={"format": {"type": "json_schema", "name": "out", "schema": schema, "strict": True}},
        tools=[TOOL],
        tool_choice={"type": "function", "name": "get_weather"},
        parallel_tool_calls=False,
    )
    message = responses_convert.responses_request_to_proto(
        request, responses_convert.input_items(request), "r", ""
    )
    assert message.response_format.json_schema.name == "out"
    assert message.response_format.json_schema.strict
    assert message.tool_choice.function_name == "get_weather"
    assert message.parallel_tool_calls is False


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"background": True}, "background"),
        ({"conversation": "conv_1"}, "conversation"),
        ({"max_tool_calls": 0}, "max_tool_calls"),
        ({"tools": [{"type": "web_search"}]}, "web_search"),
        ({"reasoning": {"effort": "extreme"}}, "reasoning"),
        ({"truncation": "auto"}, "truncation"),
        ({"include": ["message.output_text.logprobs"]}, "include"),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input"),
        ({"input": [{"type": "reasoning", "summary": [], "encrypted_content": "x"}]}, "encrypted"),
        ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]}, "input"),
        ({"input": [{"role": "user", "content": [{"type": "output_text", "text": "x"}]}]}, "output_text"),
        ({"tool_choice": {"type": "function", "name": "nope"}}, "nope"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"input": ""}, "input"),
    ],
)
async def test_what_cannot_be_honoured_is_a_400_naming_it(make_client, tmp_path: Path, fields, named) -> None:
    async with make_client(data_dir=tmp_path) as client:
        reply = await client.post("/v1/responses", json={"model": "m", "input": "Hi"} | fields)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert named in error["message"] + str(error["param"])


async def test_bad_ids_are_refused_before_the_router(make_client, tmp_path: Path) -> None:
    async with make_client(data_dir=tmp_path) as client:
        items = await client.get("/v1/responses/resp_x/input_items", params={"limit": 0})
        long_id = await client.get("/v1/responses/" + "r" * 257)
        long_after = await client.get("/v1/responses/resp_x/input_items", params={"after": "m" * 257})
        # Stored responses live behind the router (absent here): any well-formed id reaches it.
        got = await client.get("/v1/responses/resp_x")
    assert (items.status_code, items.json()["error"]["type"]) == (400, "invalid_request_error")
    assert long_id.status_code == 400 and long_after.status_code == 400
    assert got.status_code == 503


def test_a_stored_response_round_trips_through_its_proto() -> None:
    response = {"id": "resp_1", "created_at": 7, "output": [{"type": "message", "id": "msg_2"}]}
    stored = responses_convert.stored_to_proto(response, "s", [{"type": "message", "id": "msg_1"}])
    assert (stored.id, stored.created_at, stored.session_id) == ("resp_1", 7, "s")
    assert responses_convert.stored_response(stored) == response
    assert [item["id"] for item in responses_convert.conversation(stored)] == ["msg_1", "msg_2"]
    page = router_pb2.StoredResponseItems(items=stored.input_items, has_more=True)
    assert responses_convert.input_items_to_json(page) == {
        "object": "list",
        "data": [{"type": "message", "id": "msg_1"}],
        "first_id": "msg_1",
        "last_id": "msg_1",
        "has_more": True,
    }


def _chunks() -> list[router_pb2.ChatCompletionChunk]:
    call = router_pb2.ToolCallDelta
    return [
        router_pb2.ChatCompletionChunk(id="r", model="m", role="assistant", reasoning_delta="th"),
        router_pb2.ChatCompletionChunk(id="r", reasoning_delta="ink"),
        router_pb2.ChatCompletionChunk(id="r", content_delta="Hel"),
        router_pb2.ChatCompletionChunk(id="r", content_delta="lo"),
        router_pb2.ChatCompletionChunk(
            id="r", tool_call_deltas=[call(index=0, id="call_1", name="get_weather", arguments_delta='{"a"')]
        ),
        router_pb2.ChatCompletionChunk(id="r", tool_call_deltas=[call(index=0, arguments_delta=":1}")]),
        router_pb2.ChatCompletionChunk(
            id="r",
            model="m",
            finish_reason=common_pb2.FINISH_REASON_TOOL_CALLS,
            usage=common_pb2.Usage(prompt_tokens=40, cached_tokens=32, completion_tokens=9),
        ),
    ]


def test_stream_events_add_up_to_the_whole_response() -> None:
    start = responses_convert.skeleton(body(tools=[TOOL]), "resp_1", 5)
    kept: list[dict] = []
    stream = ResponseStream(start, kept.append)
    events = [event for chunk in _chunks() for event in stream(chunk)]
    assert [e["type"] for e in events] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.reasoning_text.delta",
        "response.reasoning_text.delta",
        "response.reasoning_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    final = events[-1]["response"]
    assert kept == [final]
    ResponseObject.model_validate(final)
    assert [item["type"] for item in final["output"]] == ["reasoning", "message", "function_call"]
    assert final["output"][0]["content"] == [{"type": "reasoning_text", "text": "think"}]
    assert final["output"][1]["content"][0]["text"] == "Hello"
    assert final["output"][2] | {"id": ""} == responses_convert.function_call_item(
        "", "call_1", "get_weather", '{"a":1}'
    )
    assert final["usage"] == {
        "input_tokens": 40,
        "input_tokens_details": {"cached_tokens": 32},
        "output_tokens": 9,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": 49,
    }
    # Each item's done event carries the finished item, under the id its added event gave.
    added = [e["item"]["id"] for e in events if e["type"] == "response.output_item.added"]
    done = [e["item"]["id"] for e in events if e["type"] == "response.output_item.done"]
    assert added == done == [item["id"] for item in final["output"]]


def test_whole_response_matches_the_streamed_shape_and_a_cut_one_is_incomplete() -> None:
    start = responses_convert.skeleton(body(), "resp_1", 5)
    completion = router_pb2.ChatCompletion(
        id="resp_1",
        model="m",
        content="Hi",
        reasoning_content="r",
        finish_reason=common_pb2.FINISH_REASON_LENGTH,
        usage=common_pb2.Usage(prompt_tokens=3, completion_tokens=2),
    )
    response = responses_convert.response_to_json(start, completion)
    ResponseObject.model_validate(response)
    assert response["status"] == "incomplete"
    assert response["incomplete_details"] == {"reason": "max_output_tokens"}
    assert [(item["type"], item["status"]) for item in response["output"]] == [
        ("reasoning", "completed"),
        ("message", "incomplete"),
    ]
    # Streamed, the cut item's done event says so too, and the stream ends response.incomplete.
    stream = ResponseStream(start, lambda _: None)
    events = stream(router_pb2.ChatCompletionChunk(id="r", content_delta="Hi"))
    events += stream(
        router_pb2.ChatCompletionChunk(
            id="r", finish_reason=common_pb2.FINISH_REASON_LENGTH, usage=completion.usage
        )
    )
    assert events[-2]["item"]["status"] == "incomplete"
    assert events[-1]["type"] == "response.incomplete"
    assert events[-1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}


FULL = {
    "model": "m",
    "instructions": "Be brief.",
    "input": [
        {"role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
        {"type": "function_call", "call_id": "c", "name": "get_weather", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c", "output": "sun"},
        {"type": "reasoning", "summary": [{"type": "summary_text", "text": "t"}]},
    ],
    "tools": [TOOL],
    "tool_choice": "auto",
    "text": {"format": {"type": "json_schema", "name": "o", "schema": {"type": "object"}}},
    "max_output_tokens": 5,
    "temperature": 0.5,
    "top_p": 0.5,
    "store": True,
    "stream": False,
    "metadata": {"k": "v"},
    "previous_response_id": None,
}
ODD_VALUES = [None, 0, -1, 1e308, "", "x\x00", [], [{}], {}, {"type": None}, True]


async def test_odd_values_anywhere_are_never_a_server_error(make_client, tmp_path: Path) -> None:
    """Every top-level field and every field of every input item, replaced by each odd value:
    a 400 (or the absent router's 503 for a body that happens to be valid), never a 500."""
    bodies = [FULL | {name: value} for name in FULL for value in ODD_VALUES]
    for index, item in enumerate(FULL["input"]):
        for name in item:
            for value in ODD_VALUES:
                items = list(FULL["input"])
                items[index] = item | {name: value}
                bodies.append(FULL | {"input": items})
    async with make_client(data_dir=tmp_path) as client:
        for sent in bodies:
            reply = await client.post("/v1/responses", json=sent)
            assert reply.status_code in (400, 503), (sent, reply.text)
            assert set(reply.json()["error"]) == {"message", "type", "param", "code"}


def test_a_stream_that_fails_midway_ends_with_an_error_event() -> None:
    stream = ResponseStream(responses_convert.skeleton(body(), "resp_1", 5), lambda _: None)
    events = stream(router_pb2.ChatCompletionChunk(id="r", content_delta="Hi"))
    error = stream.error_event(BridgeError(503, "engine gone", "service_unavailable"))
    assert error == {
        "type": "error",
        "sequence_number": len(events),
        "code": "service_unavailable",
        "message": "engine gone",
        "param": None,
    }


async def test_a_stream_is_stored_before_its_last_events_or_ends_with_the_store_s_error() -> None:
    finished: list[dict] = []
    sent: list[bytes] = []

    async def events():
        yield b"created"
        finished.append({"id": "resp_1"})  # the last chunk rendered: its events follow
        yield b"completed"

    dialect = SSEDialect(lambda event: b"", lambda error: f"error:{error.status}".encode(), b"")

    async def keep(response: dict) -> None:
        assert response == {"id": "resp_1"} and sent == [b"created"]

    async for event in _stored_first(events(), finished, keep, dialect):
        sent.append(event)
    assert sent == [b"created", b"completed"]

    async def refused(_response: dict) -> None:
        raise BridgeError(503, "router gone", "service_unavailable")

    finished.clear()
    out = [event async for event in _stored_first(events(), finished, refused, dialect)]
    assert out == [b"created", b"error:503"]
