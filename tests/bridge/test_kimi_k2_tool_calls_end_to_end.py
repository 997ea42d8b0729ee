"""Kimi K2's tool path through real processes: bridge -> router -> tokenizer / engine on the tiny K2 model.

The tiny checkpoint has DeepSeek-V3's architecture, K2's special tokens and K2's own
chat template. A forced call is written in K2's format under the grammar (empty
think block, then the call section), read by the K2 parser (the call id is the
model's ``functions.NAME:IDX``), and the tool-result turn renders it back through
K2's template as the same tokens, so the second prompt starts with the first
prompt and the call, and its cached tokens cover the first turn.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import grpc
import openai
import pytest
from service_processes import (
    ENGINE_SERVER_BUILT,
    CachetStack,
    ServiceProcess,
)

from cachet.bridge import convert, schemas
from cachet.models.tiny import TINY_MODEL_IDS, write_tiny_model
from cachet.tokenizer.v1 import tokenizer_pb2, tokenizer_pb2_grpc

MODEL = TINY_MODEL_IDS["kimi-k2"]
TIMEOUT = 120.0
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12}, "days": {"type": "integer"}},
    "required": ["city", "days"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Forecast.", "parameters": WEATHER},
    },
    {"type": "function", "function": {"name": "get_time", "description": "The current time."}},
]
NAMED = {"type": "function", "function": {"name": "get_weather"}}
SAMPLED = {"temperature": 1.0, "max_tokens": 120}


@dataclass
class KimiPlatform:
    stack: CachetStack
    bridge: ServiceProcess

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(
            base_url=f"http://{self.bridge.address}/v1", api_key="dev", max_retries=0, timeout=TIMEOUT
        )

    def tokenizer(self) -> tokenizer_pb2_grpc.TokenizerServiceStub:
        return tokenizer_pb2_grpc.TokenizerServiceStub(grpc.insecure_channel(self.stack.address("tokenizer")))


@pytest.fixture(scope="module")
def kimi(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KimiPlatform]:
    if not ENGINE_SERVER_BUILT:
        pytest.skip("the engine server (cachet.engine.main) is not built yet")
    root = tmp_path_factory.mktemp("kimi-e2e")
    stack = CachetStack(root, write_tiny_model(root / MODEL, family="kimi-k2")).start(engines=1)
    try:
        yield KimiPlatform(stack, stack.start_bridge())
    finally:
        stack.stop()
        print(stack.logs())


def conversation() -> list[dict]:
    return [
        {"role": "system", "content": f"[{uuid.uuid4().hex}] You are a weather assistant. Use the tools."},
        {"role": "user", "content": "What is the weather in Paris for the next two days?"},
    ]


def check_weather(arguments: str) -> None:
    value = json.loads(arguments)
    assert set(value) == {"city", "days"}
    assert isinstance(value["city"], str) and len(value["city"]) <= 12
    assert isinstance(value["days"], int)


def test_forced_call_is_written_and_read_in_kimi_format(kimi: KimiPlatform) -> None:
    client, messages = kimi.client(), conversation()
    for seed in range(3):
        response = client.chat.completions.create(
            model=MODEL, messages=messages, tools=TOOLS, tool_choice=NAMED, seed=seed, **SAMPLED
        )
        choice = response.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        assert choice.message.content is None and not getattr(choice.message, "reasoning_content", None)
        (call,) = choice.message.tool_calls
        # K2's own id, kept: its template writes it back as "## Return of <id>".
        assert re.fullmatch(r"functions\.get_weather:\d+", call.id), call.id
        assert call.function.name == "get_weather"
        check_weather(call.function.arguments)
        deltas = [
            delta
            for event in client.chat.completions.create(
                model=MODEL,
                messages=messages,
                tools=TOOLS,
                tool_choice=NAMED,
                seed=seed,
                stream=True,
                **SAMPLED,
            )
            for event_choice in event.choices
            for delta in event_choice.delta.tool_calls or []
        ]
        header, fragments = deltas[0], deltas[1:]
        assert (header.id, header.function.name, header.function.arguments) == (call.id, "get_weather", "")
        assert len(fragments) > 1
        assert "".join(f.function.arguments for f in fragments) == call.function.arguments


def test_required_call_in_kimi_format(kimi: KimiPlatform) -> None:
    response = kimi.client().chat.completions.create(
        model=MODEL,
        messages=conversation(),
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        seed=11,
        **SAMPLED,
    )
    (call,) = response.choices[0].message.tool_calls
    assert re.fullmatch(rf"functions\.{call.function.name}:\d+", call.id)
    if call.function.name == "get_weather":
        check_weather(call.function.arguments)
    else:
        assert json.loads(call.function.arguments) == {}


def render(kimi: KimiPlatform, turn: list[dict]) -> list[int]:
    body = schemas.ChatCompletionBody(model=MODEL, messages=turn, tools=TOOLS)
    proto = convert.chat_request_to_proto(body)
    reply = kimi.tokenizer().ApplyChatTemplate(
        tokenizer_pb2.ApplyChatTemplateRequest(
            model=MODEL, messages=proto.messages, tools=proto.tools, add_generation_prompt=True
        ),
        timeout=TIMEOUT,
    )
    return list(reply.token_ids)


def test_tool_result_turn_renders_the_call_back_as_generated(kimi: KimiPlatform) -> None:
    client, messages = kimi.client(), conversation()
    session = {"x-session-affinity": uuid.uuid4().hex}
    first = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        tools=TOOLS,
        tool_choice=NAMED,
        seed=1,
        extra_headers=session,
        **SAMPLED,
    )
    (call,) = first.choices[0].message.tool_calls
    assistant = {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": call.id,
                "type": "function",
                "function": {"name": "get_weather", "arguments": call.function.arguments},
            }
        ],
    }
    result = {"role": "tool", "tool_call_id": call.id, "content": '{"forecast": ["sun", "rain"]}'}
    turn_two = [*messages, assistant, result]

    # What the model wrote (K2 markers are special tokens), then its end-of-turn token.
    written = (
        "<think></think><|tool_calls_section_begin|><|tool_call_begin|>"
        f"{call.id}<|tool_call_argument_begin|>{call.function.arguments}"
        "<|tool_call_end|><|tool_calls_section_end|><|im_end|>"
    )
    stub = kimi.tokenizer()
    output = list(
        stub.Encode(tokenizer_pb2.EncodeRequest(model=MODEL, text=written), timeout=TIMEOUT).token_ids
    )
    # The call re-encodes to the tokens generated; the end-of-turn token is among them unless the
    # engine ended the turn itself when the grammar finished (the template writes it either way).
    assert first.usage.completion_tokens in (len(output) - 1, len(output))
    first_prompt, second_prompt = render(kimi, messages), render(kimi, turn_two)
    assert len(first_prompt) == first.usage.prompt_tokens
    assert second_prompt[: len(first_prompt) + len(output)] == first_prompt + output
    tail = stub.Decode(
        tokenizer_pb2.DecodeRequest(model=MODEL, token_ids=second_prompt[len(first_prompt) + len(output) :]),
        timeout=TIMEOUT,
    ).text
    assert f"## Return of {call.id}" in tail and "sun" in tail

    second = client.chat.completions.create(
        model=MODEL, messages=turn_two, tools=TOOLS, seed=1, max_tokens=8, extra_headers=session
    )
    covered = (first.usage.prompt_tokens - 1) // 16 * 16
    assert covered > 0
    assert second.usage.prompt_tokens == len(second_prompt)
    assert second.usage.prompt_tokens_details.cached_tokens >= covered
