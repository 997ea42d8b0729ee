"""Tool calling through the whole platform with the openai client (bridge -> router -> tokenizer / engine).

The tiny model has random weights, so what it writes under ``auto`` is noise;
these tests hold what does not depend on its wisdom: the request and response
shapes, streamed deltas adding up to the whole answer (name first, then argument
fragments), ``tool_choice: none`` offering nothing, a tool-result turn reusing
the first turn's cached prefix and rendering prefix-stably (forced calls too),
forced calls and strict tools that always parse and validate, and Workers AI's
tool fields.
"""

# ruff: noqa: F811 (pytest fixtures imported from test_end_to_end are parameters here)
from __future__ import annotations

import json
import uuid
from collections.abc import Iterator

import grpc
import httpx
import openai
import pytest

from cachet.tokenizer.v1 import tokenizer_pb2, tokenizer_pb2_grpc

from .test_end_to_end import TIMEOUT, TINY_MODEL_ID, Platform, platform  # noqa: F401 (the fixture)

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12}, "days": {"type": "integer"}},
    "required": ["city", "days"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather forecast for a city.",
            "parameters": WEATHER,
        },
    },
    {"type": "function", "function": {"name": "get_time", "description": "The current time."}},
]
GREEDY = {"temperature": 0, "max_tokens": 12, "seed": 7}


def conversation() -> list[dict]:
    # A fresh nonce: only the turns of one test share a cached prefix.
    return [
        {"role": "system", "content": f"[{uuid.uuid4().hex}] You are a weather assistant. Use the tools."},
        {"role": "user", "content": "What is the weather in Paris for the next two days?"},
    ]


def joined_stream(stream: Iterator) -> dict:
    """The streamed deltas accumulated by index, as an OpenAI client does."""
    content, reasoning, finish, calls = "", "", None, {}
    for event in stream:
        if not event.choices:
            continue
        choice = event.choices[0]
        delta = choice.delta
        content += delta.content or ""
        reasoning += getattr(delta, "reasoning_content", None) or ""
        for call in delta.tool_calls or []:
            entry = calls.setdefault(call.index, {"id": None, "name": None, "arguments": ""})
            if call.id:
                assert call.type == "function"
                entry["id"], entry["name"] = call.id, call.function.name
            entry["arguments"] += call.function.arguments or ""
        finish = choice.finish_reason or finish
    return {
        "content": content or None,
        "tool_calls": [calls[i] for i in sorted(calls)],
        "finish_reason": finish,
    }


def whole(response: openai.types.chat.ChatCompletion) -> dict:
    message = response.choices[0].message
    return {
        "content": message.content or None,
        "tool_calls": [
            {"id": call.id, "name": call.function.name, "arguments": call.function.arguments}
            for call in message.tool_calls or []
        ],
        "finish_reason": response.choices[0].finish_reason,
    }


def without_ids(answer: dict) -> dict:
    return answer | {"tool_calls": [call | {"id": None} for call in answer["tool_calls"]]}


def test_auto_streamed_deltas_add_up_to_the_whole_answer(platform: Platform) -> None:
    client, messages = platform.client(), conversation()
    response = client.chat.completions.create(model=TINY_MODEL_ID, messages=messages, tools=TOOLS, **GREEDY)
    streamed = joined_stream(
        client.chat.completions.create(
            model=TINY_MODEL_ID, messages=messages, tools=TOOLS, stream=True, **GREEDY
        )
    )
    assert without_ids(streamed) == without_ids(whole(response))
    expected = "tool_calls" if response.choices[0].message.tool_calls else "length"
    assert response.choices[0].finish_reason in (expected, "stop")


def test_tool_choice_none_offers_no_tools(platform: Platform) -> None:
    client, messages = platform.client(), conversation()
    offered = client.chat.completions.create(
        model=TINY_MODEL_ID, messages=messages, tools=TOOLS, max_tokens=1
    )
    withheld = client.chat.completions.create(
        model=TINY_MODEL_ID, messages=messages, tools=TOOLS, tool_choice="none", max_tokens=1
    )
    plain = client.chat.completions.create(model=TINY_MODEL_ID, messages=messages, max_tokens=1)
    assert withheld.usage.prompt_tokens == plain.usage.prompt_tokens < offered.usage.prompt_tokens
    assert withheld.choices[0].message.tool_calls is None


def call_turn(messages: list[dict]) -> list[dict]:
    call = {
        "id": "call_abc123",
        "type": "function",
        "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris", "days": 2})},
    }
    return [
        *messages,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_abc123", "content": '{"forecast": ["sun", "rain"]}'},
    ]


def test_tool_result_turn_reports_the_first_turn_as_cached(platform: Platform) -> None:
    client, messages = platform.client(), conversation()
    session = {"x-session-affinity": uuid.uuid4().hex}
    first = client.chat.completions.create(
        model=TINY_MODEL_ID, messages=messages, tools=TOOLS, extra_headers=session, **GREEDY
    )
    second = client.chat.completions.create(
        model=TINY_MODEL_ID, messages=call_turn(messages), tools=TOOLS, extra_headers=session, **GREEDY
    )
    assert second.usage.prompt_tokens > first.usage.prompt_tokens
    # Every whole 16-token block of the first prompt is served from cache (the engine
    # computes at least the last prompt token itself, hence the -1).
    covered = (first.usage.prompt_tokens - 1) // 16 * 16
    assert covered > 0
    assert second.usage.prompt_tokens_details.cached_tokens >= covered


def test_second_turn_prompt_starts_with_first_prompt_and_the_call_as_generated(platform: Platform) -> None:
    """Prefix-stable rendering: turn 2's tokens = turn 1's prompt + the model's call tokens + more."""
    stub = tokenizer_pb2_grpc.TokenizerServiceStub(grpc.insecure_channel(platform.stack.address("tokenizer")))
    messages = conversation()
    tools = [
        {
            "name": "get_weather",
            "description": "Weather forecast for a city.",
            "parameters_schema_json": json.dumps(WEATHER),
        }
    ]

    def render(turn: list[dict]) -> list[int]:
        from cachet.bridge import convert, schemas

        body = schemas.ChatCompletionBody(model=TINY_MODEL_ID, messages=turn, tools=TOOLS[:1])
        proto = convert.chat_request_to_proto(body)
        reply = stub.ApplyChatTemplate(
            tokenizer_pb2.ApplyChatTemplateRequest(
                model=TINY_MODEL_ID, messages=proto.messages, tools=proto.tools, add_generation_prompt=True
            ),
            timeout=TIMEOUT,
        )
        return list(reply.token_ids)

    assert tools  # the same tool as TOOLS[0], offered in both turns
    first = render(messages)
    # What a model following the generic tool prompt writes, then its end-of-turn token.
    written = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call><|im_end|>'
    output = list(
        stub.Encode(tokenizer_pb2.EncodeRequest(model=TINY_MODEL_ID, text=written), timeout=TIMEOUT).token_ids
    )
    second = render(call_turn(messages))
    assert second[: len(first) + len(output)] == first + output


def check_weather_call(arguments: str) -> None:
    value = json.loads(arguments)
    assert set(value) == {"city", "days"}
    assert isinstance(value["city"], str) and len(value["city"]) <= 12
    assert isinstance(value["days"], int)


@pytest.mark.parametrize(
    "choice",
    [{"type": "function", "function": {"name": "get_weather"}}, "required"],
    ids=["named", "required"],
)
def test_forced_tool_call_always_parses_and_validates(platform: Platform, choice: object) -> None:
    client, messages = platform.client(), conversation()
    # Sampled, not greedy: whatever the random model picks, the grammar keeps it valid.
    sampling = {"temperature": 1.0, "max_tokens": 120, "parallel_tool_calls": False}
    for seed in range(3):
        response = client.chat.completions.create(
            model=TINY_MODEL_ID, messages=messages, tools=TOOLS, tool_choice=choice, seed=seed, **sampling
        )
        answer = whole(response)
        assert answer["finish_reason"] == "tool_calls", answer
        assert len(answer["tool_calls"]) == 1
        call = answer["tool_calls"][0]
        assert call["id"].startswith("call_")
        if choice != "required":
            assert call["name"] == "get_weather"
        if call["name"] == "get_weather":
            check_weather_call(call["arguments"])
        else:
            assert json.loads(call["arguments"]) == {}
        streamed = joined_stream(
            client.chat.completions.create(
                model=TINY_MODEL_ID,
                messages=messages,
                tools=TOOLS,
                tool_choice=choice,
                seed=seed,
                stream=True,
                **sampling,
            )
        )
        assert without_ids(streamed) == without_ids(answer)


def test_forced_call_streams_name_first_then_argument_fragments(platform: Platform) -> None:
    """OpenAI's stream shape: index, id, type and name with arguments "", then argument text only."""
    client, messages = platform.client(), conversation()
    choice = {"type": "function", "function": {"name": "get_weather"}}
    sampling = {"temperature": 1.0, "max_tokens": 120, "seed": 3}
    whole_call = whole(
        client.chat.completions.create(
            model=TINY_MODEL_ID, messages=messages, tools=TOOLS, tool_choice=choice, **sampling
        )
    )["tool_calls"][0]
    deltas = [
        call
        for event in client.chat.completions.create(
            model=TINY_MODEL_ID, messages=messages, tools=TOOLS, tool_choice=choice, stream=True, **sampling
        )
        for choice_delta in event.choices
        for call in choice_delta.delta.tool_calls or []
    ]
    header, fragments = deltas[0], deltas[1:]
    assert (header.index, header.type, header.function.name, header.function.arguments) == (
        0,
        "function",
        "get_weather",
        "",
    )
    assert header.id.startswith("call_")
    assert len(fragments) > 1, "a call with arguments streams in more than one fragment"
    assert all(f.index == 0 and f.id is None and f.function.name is None for f in fragments)
    arguments = "".join(f.function.arguments for f in fragments)
    assert arguments == whole_call["arguments"]
    check_weather_call(arguments)


def run_workers_ai(platform: Platform, body: dict) -> httpx.Response:
    return httpx.post(f"{platform.url}/ai/run/{TINY_MODEL_ID}", json=body, timeout=TIMEOUT)


@pytest.mark.parametrize(
    "choice",
    [{"type": "function", "function": {"name": "get_weather"}}, "required"],
    ids=["named", "required"],
)
def test_workers_ai_forwards_tools_and_tool_choice(platform: Platform, choice: object) -> None:
    """/ai/run takes flat tools and tool_choice; calls come back as Workers AI's {name, arguments}."""
    flat_tools = [
        {"name": "get_weather", "description": "Weather forecast for a city.", "parameters": WEATHER},
        {"name": "get_time", "description": "The current time."},
    ]
    body = {
        "messages": conversation(),
        "tools": flat_tools,
        "tool_choice": choice,
        "parallel_tool_calls": False,
        "temperature": 1.0,
        "max_tokens": 120,
        "seed": 5,
    }
    reply = run_workers_ai(platform, body)
    assert reply.status_code == 200, reply.text
    result = reply.json()["result"]
    (call,) = result["tool_calls"]
    assert set(call) == {"name", "arguments"}
    assert isinstance(call["arguments"], dict), "Workers AI answers arguments as an object"
    if choice != "required":
        assert call["name"] == "get_weather"
    if call["name"] == "get_weather":
        check_weather_call(json.dumps(call["arguments"]))
    else:
        assert call["arguments"] == {}
    with httpx.stream(
        "POST", f"{platform.url}/ai/run/{TINY_MODEL_ID}", json=body | {"stream": True}, timeout=TIMEOUT
    ) as response:
        events = [
            json.loads(line.removeprefix("data: "))
            for line in response.read().decode().split("\n\n")
            if line.startswith("data: {")
        ]
    fragments = [call for event in events for call in event.get("tool_calls", [])]
    assert fragments[0]["name"] == call["name"] and fragments[0]["arguments"] == ""
    assert json.loads("".join(f["arguments"] for f in fragments)) == call["arguments"]


def test_workers_ai_tool_choice_naming_no_tool_is_refused(platform: Platform) -> None:
    reply = run_workers_ai(
        platform,
        {
            "prompt": "hi",
            "tools": [{"name": "get_time"}],
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        },
    )
    assert reply.status_code == 400, reply.text
    assert "get_weather" in reply.text


def test_strict_tools_under_auto_are_enforced_by_grammar(platform: Platform) -> None:
    """Free text or valid calls: the engine runs the router's grammar for strict tools under auto.

    (The grammar itself is walked at random in tests/router/test_strict_auto_grammar.py; here
    the random model writes what it likes at temperature 1 and nothing it writes breaks it.)
    """
    client, messages = platform.client(), conversation()
    strict_tools = [tool | {"function": tool["function"] | {"strict": True}} for tool in TOOLS]
    for seed in range(6):
        answer = whole(
            client.chat.completions.create(
                model=TINY_MODEL_ID,
                messages=messages,
                tools=strict_tools,
                temperature=1.0,
                max_tokens=40,
                seed=seed,
            )
        )
        for call in answer["tool_calls"]:
            if call["name"] == "get_weather":
                check_weather_call(call["arguments"])
            else:
                assert json.loads(call["arguments"]) == {}
        # A tag the model writes must open a call the grammar checks: it is never left as text.
        assert "<tool_call>" not in (answer["content"] or "")


def test_forced_call_turn_is_prefix_stable(platform: Platform) -> None:
    """A forced call is written as the template renders it back: turn 2 = turn 1 + the call tokens + more."""
    client, messages = platform.client(), conversation()
    session = {"x-session-affinity": uuid.uuid4().hex}
    first = client.chat.completions.create(
        model=TINY_MODEL_ID,
        messages=messages,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        temperature=1.0,
        max_tokens=120,
        seed=2,
        extra_headers=session,
    )
    (call,) = first.choices[0].message.tool_calls
    turn_two = [
        *messages,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"forecast": ["sun"]}'},
    ]
    stub = tokenizer_pb2_grpc.TokenizerServiceStub(grpc.insecure_channel(platform.stack.address("tokenizer")))

    def render(turn: list[dict]) -> list[int]:
        from cachet.bridge import convert, schemas

        proto = convert.chat_request_to_proto(
            schemas.ChatCompletionBody(model=TINY_MODEL_ID, messages=turn, tools=TOOLS)
        )
        request = tokenizer_pb2.ApplyChatTemplateRequest(
            model=TINY_MODEL_ID, messages=proto.messages, tools=proto.tools, add_generation_prompt=True
        )
        return list(stub.ApplyChatTemplate(request, timeout=TIMEOUT).token_ids)

    written = f'<tool_call>\n{{"name": "get_weather", "arguments": {call.function.arguments}}}\n</tool_call>'
    output = list(
        stub.Encode(tokenizer_pb2.EncodeRequest(model=TINY_MODEL_ID, text=written), timeout=TIMEOUT).token_ids
    )
    assert first.usage.completion_tokens in (len(output), len(output) + 1)  # + the end-of-turn token
    first_prompt, second_prompt = render(messages), render(turn_two)
    assert second_prompt[: len(first_prompt) + len(output)] == first_prompt + output
    # Seeded like the first turn: seeded and greedy turns name their KV apart from unseeded
    # sampled ones (reproducible greedy, docs/ARCHITECTURE.md).
    second = client.chat.completions.create(
        model=TINY_MODEL_ID, messages=turn_two, tools=TOOLS, max_tokens=4, seed=3, extra_headers=session
    )
    assert second.usage.prompt_tokens_details.cached_tokens >= (first.usage.prompt_tokens - 1) // 16 * 16
