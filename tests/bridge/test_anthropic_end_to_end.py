"""Anthropic's Messages API through the whole platform, driven by the official ``anthropic`` client.

Real processes on the tiny random-weight model (tests/service_processes.py), one
engine: the anthropic client -> bridge -> router -> tokenizer / engine / usage. The
model's words are noise; these tests hold the shapes, that a stream adds up to the
whole answer, forced tool calls, cached input on a second turn, count_tokens
agreeing with what a message is billed, and the ledger's record of it. Each test
leads its prompt with a fresh nonce, so only turns meant to share a prefix do.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator

import anthropic
import httpx
import pytest
from service_processes import ENGINE_SERVER_BUILT, TINY_MODEL_ID, CachetStack

from cachet.bridge.anthropic_schemas import MessageResponse, MessageStreamEventOut
from cachet.models.tiny import write_tiny_model

from .test_end_to_end import TIMEOUT, Platform, block_retentions

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12}, "days": {"type": "integer"}},
    "required": ["city", "days"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "name": "get_weather",
        "description": "Weather forecast for a city.",
        "input_schema": WEATHER,
        "cache_control": {"type": "ephemeral"},
    },
    {"name": "get_time", "description": "The current time.", "input_schema": {"type": "object"}},
]
# This SDK's create() has no sampling arguments (its newest models take none): they go as extra body.
GREEDY = {"max_tokens": 6, "extra_body": {"temperature": 0}}


@pytest.fixture(scope="module")
def platform(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Platform]:
    if not ENGINE_SERVER_BUILT:
        pytest.skip("the engine server (cachet.engine.main) is not built yet")
    root = tmp_path_factory.mktemp("anthropic-e2e")
    stack = CachetStack(root, write_tiny_model(root / TINY_MODEL_ID)).start(engines=1)
    try:
        # count_tokens renders prompts through the tokenizer itself.
        bridge = stack.start_bridge(CACHET_BRIDGE_TOKENIZER_ADDRESS=stack.address("tokenizer"))
        yield Platform(stack, bridge)
    finally:
        stack.stop()
        print(stack.logs())


def client(platform: Platform, session: str | None = None) -> anthropic.Anthropic:
    headers = {"x-session-affinity": session} if session else None
    return anthropic.Anthropic(
        base_url=platform.url, api_key="dev", max_retries=0, timeout=TIMEOUT, default_headers=headers
    )


def system() -> list[dict]:
    # Long enough to fill whole 16-token blocks; cache_control keeps the prefix up to it.
    text = f"[{uuid.uuid4().hex}] You are a terse weather assistant. Answer in one short sentence, no more."
    return [{"type": "text", "text": text, "cache_control": {"type": "ephemeral"}}]


QUESTION = [{"role": "user", "content": "What is the weather in Paris for the next two days?"}]


def prompt_tokens(usage: anthropic.types.Usage) -> int:
    return (
        usage.input_tokens + (usage.cache_read_input_tokens or 0) + (usage.cache_creation_input_tokens or 0)
    )


def test_message_reports_cached_input_and_is_billed_by_the_ledger(platform: Platform) -> None:
    session, prompt = uuid.uuid4().hex, system()
    first = client(platform, session).messages.create(
        model=TINY_MODEL_ID, system=prompt, messages=QUESTION, **GREEDY
    )
    MessageResponse.model_validate(first.model_dump(exclude_none=True) | {"stop_sequence": None})
    assert first.id.startswith("msg_")
    assert (first.type, first.role, first.model) == ("message", "assistant", TINY_MODEL_ID)
    assert all(block.type == "text" for block in first.content)
    assert first.stop_reason in ("max_tokens", "end_turn")
    assert 1 <= first.usage.output_tokens <= 6
    again = client(platform, session).messages.create(
        model=TINY_MODEL_ID, system=prompt, messages=QUESTION, **GREEDY
    )
    # The same prompt again comes from the prefix cache, and input_tokens leaves those out.
    assert again.usage.cache_read_input_tokens > 0
    assert again.usage.cache_creation_input_tokens == 0
    assert prompt_tokens(again.usage) == prompt_tokens(first.usage)
    assert again.usage.input_tokens == prompt_tokens(first.usage) - again.usage.cache_read_input_tokens
    assert again.content == first.content
    # Billed by the same ledger as chat completions, cached input apart.
    expected = {
        "requests": 2,
        "prompt_tokens": prompt_tokens(first.usage) * 2,
        "cached_tokens": first.usage.cache_read_input_tokens + again.usage.cache_read_input_tokens,
        "completion_tokens": first.usage.output_tokens + again.usage.output_tokens,
    }
    assert ledger(platform, session) == expected


def ledger(platform: Platform, session: str) -> dict:
    """The session's row of /v1/usage, once the router's recorder has sent both records."""
    deadline, row = time.monotonic() + 30, {}
    while time.monotonic() < deadline:
        params = {"session": session, "group_by": "session"}
        rows = httpx.get(f"{platform.url}/v1/usage", params=params, timeout=TIMEOUT).json()["data"]
        row = (
            {key: rows[0][key] for key in ("requests", "prompt_tokens", "cached_tokens", "completion_tokens")}
            if rows
            else {}
        )
        if row.get("requests") == 2:
            return row
        time.sleep(0.2)
    return row


def test_cache_control_keeps_the_prefix_up_to_the_breakpoint_in_the_engine(platform: Platform) -> None:
    question = [{"role": "user", "content": "What is the weather in Paris, Rome, Oslo and Lisbon " * 8}]
    before = block_retentions(platform)
    # A breakpoint on the system prompt: its blocks, not the long question's after it.
    at_system = client(platform).messages.create(
        model=TINY_MODEL_ID, system=system(), messages=question, **GREEDY
    )
    prefix = block_retentions(platform) - before
    computed = prompt_tokens(at_system.usage) + at_system.usage.output_tokens - 1
    assert 0 < prefix < computed // 16 - 2
    # Automatic caching (the top-level cache_control): the whole request.
    before = block_retentions(platform)
    whole = client(platform).messages.create(
        model=TINY_MODEL_ID,
        system=f"[{uuid.uuid4().hex}] You are a terse weather assistant.",
        messages=question,
        **GREEDY | {"extra_body": GREEDY["extra_body"] | {"cache_control": {"type": "ephemeral"}}},
    )
    computed = prompt_tokens(whole.usage) + whole.usage.output_tokens - 1
    assert block_retentions(platform) - before == computed // 16


def test_stream_adds_up_to_the_plain_answer(platform: Platform) -> None:
    prompt = system()
    plain = client(platform).messages.create(model=TINY_MODEL_ID, system=prompt, messages=QUESTION, **GREEDY)
    with client(platform).messages.stream(
        model=TINY_MODEL_ID, system=prompt, messages=QUESTION, **GREEDY
    ) as stream:
        streamed = stream.get_final_message()
    assert [block.to_dict() for block in streamed.content] == [block.to_dict() for block in plain.content]
    assert streamed.stop_reason == plain.stop_reason
    assert streamed.usage.output_tokens == plain.usage.output_tokens
    # The totals come with message_delta and replace message_start's zeros.
    assert prompt_tokens(streamed.usage) == prompt_tokens(plain.usage)
    assert streamed.usage.cache_read_input_tokens > 0


def test_stream_on_the_wire_is_typed_events(platform: Platform) -> None:
    body = {"model": TINY_MODEL_ID, "system": system(), "messages": QUESTION, "stream": True, **GREEDY}
    with httpx.stream("POST", f"{platform.url}/v1/messages", json=body, timeout=TIMEOUT) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        text = response.read().decode()
    frames = [frame for frame in text.split("\n\n") if frame]
    kinds = []
    for frame in frames:
        event_line, data_line = frame.split("\n")
        kind = event_line.removeprefix("event: ")
        event = MessageStreamEventOut.model_validate_json(data_line.removeprefix("data: ")).root
        assert event.type == kind
        kinds.append(kind)
    assert kinds[:2] == ["message_start", "ping"]
    assert kinds[-2:] == ["message_delta", "message_stop"]
    assert "[DONE]" not in text


def forced_call(message: anthropic.types.Message) -> anthropic.types.ToolUseBlock:
    """The one call a forced tool_choice makes: the schema's object, whatever the weights."""
    calls = [block for block in message.content if block.type == "tool_use"]
    assert len(calls) == 1 and calls[0].name == "get_weather", message
    assert set(calls[0].input) == {"city", "days"}, message
    assert isinstance(calls[0].input["city"], str) and len(calls[0].input["city"]) <= 12
    assert isinstance(calls[0].input["days"], int)
    assert message.stop_reason == "tool_use"
    return calls[0]


def test_forced_tool_call_streamed_and_whole_then_a_tool_result_turn(platform: Platform) -> None:
    session, prompt = uuid.uuid4().hex, system()
    # Sampled, not greedy (greedy random weights pad JSON with whitespace to max_tokens):
    # whatever the model picks, the grammar keeps the call valid.
    forced = {
        "tools": TOOLS,
        "tool_choice": {"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True},
        "max_tokens": 120,
        "extra_body": {"temperature": 1.0},
    }
    whole = client(platform, session).messages.create(
        model=TINY_MODEL_ID, system=prompt, messages=QUESTION, **forced
    )
    call = forced_call(whole)
    with client(platform, session).messages.stream(
        model=TINY_MODEL_ID, system=prompt, messages=QUESTION, **forced
    ) as stream:
        forced_call(stream.get_final_message())
    result_turn = [
        *QUESTION,
        {"role": "assistant", "content": [block.model_dump(exclude_none=True) for block in whole.content]},
        {
            "role": "user",
            "content": [
                {
                    "type": "tool_result",
                    "tool_use_id": call.id,
                    "content": '{"forecast": ["sun", "rain"]}',
                },
                {"type": "text", "text": "Summarise it.", "cache_control": {"type": "ephemeral"}},
            ],
        },
    ]
    # Sampled like the first turn: a greedy turn's KV is named apart from a sampled one's
    # (reproducible greedy, docs/ARCHITECTURE.md), so it would not read the first turn's blocks.
    second = client(platform, session).messages.create(
        model=TINY_MODEL_ID,
        system=prompt,
        messages=result_turn,
        tools=TOOLS,
        max_tokens=6,
        extra_body={"temperature": 1.0},
    )
    assert prompt_tokens(second.usage) > prompt_tokens(whole.usage)
    # The first turn's whole blocks come from the cache.
    assert second.usage.cache_read_input_tokens >= (prompt_tokens(whole.usage) - 1) // 16 * 16 > 0


def test_count_tokens_is_what_a_message_is_billed(platform: Platform) -> None:
    prompt, sdk = system(), client(platform)
    counted = sdk.messages.count_tokens(model=TINY_MODEL_ID, system=prompt, messages=QUESTION, tools=TOOLS)
    bare = sdk.messages.count_tokens(model=TINY_MODEL_ID, system=prompt, messages=QUESTION)
    withheld = sdk.messages.count_tokens(
        model=TINY_MODEL_ID, system=prompt, messages=QUESTION, tools=TOOLS, tool_choice={"type": "none"}
    )
    assert counted.input_tokens > bare.input_tokens == withheld.input_tokens
    message = sdk.messages.create(
        model=TINY_MODEL_ID, system=prompt, messages=QUESTION, tools=TOOLS, max_tokens=1
    )
    assert prompt_tokens(message.usage) == counted.input_tokens


def test_errors_through_the_sdk(platform: Platform) -> None:
    sdk = client(platform)
    with pytest.raises(anthropic.NotFoundError) as unknown:
        sdk.messages.create(model="no-such-model", messages=QUESTION, max_tokens=4)
    assert unknown.value.body["type"] == "error"
    with pytest.raises(anthropic.BadRequestError, match="thinking"):
        sdk.messages.create(
            model=TINY_MODEL_ID,
            messages=QUESTION,
            max_tokens=4,
            thinking={"type": "enabled", "budget_tokens": 1024},
        )
    # The router's own refusal (a prompt over the context window), in Anthropic's shape.
    with pytest.raises(anthropic.BadRequestError, match="context window") as window:
        sdk.messages.create(
            model=TINY_MODEL_ID, messages=[{"role": "user", "content": "hi " * 2500}], max_tokens=4
        )
    assert window.value.body["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.NotFoundError):
        sdk.messages.count_tokens(model="no-such-model", messages=QUESTION)


def test_a_matched_stop_sequence_is_named_whole_and_streamed(platform: Platform) -> None:
    """The engine matches stop strings and names the one that ended the answer; Anthropic's
    stop_reason is then "stop_sequence" with that string, the text ending before it."""
    prompt, longer = system(), {"max_tokens": 16, "extra_body": {"temperature": 0}}
    free = client(platform).messages.create(model=TINY_MODEL_ID, system=prompt, messages=QUESTION, **longer)
    text = "".join(block.text for block in free.content if block.type == "text")
    assert text
    # The first character the greedy answer writes for the first time past its start (the tiny
    # model may write one character over and over: then its first).
    start = next((i for i in range(1, len(text)) if text[i] not in text[:i]), 0)
    stop = text[start]
    stopped = client(platform).messages.create(
        model=TINY_MODEL_ID, system=prompt, messages=QUESTION, stop_sequences=[stop, "\uffff"], **longer
    )
    assert (stopped.stop_reason, stopped.stop_sequence) == ("stop_sequence", stop)
    assert "".join(b.text for b in stopped.content if b.type == "text") == text[:start]
    with client(platform).messages.stream(
        model=TINY_MODEL_ID, system=prompt, messages=QUESTION, stop_sequences=[stop], **longer
    ) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == text[:start]
    assert (final.stop_reason, final.stop_sequence) == ("stop_sequence", stop)
