"""OpenAI's Responses API through the whole platform, driven by the official ``openai`` client.

Real processes on the tiny random-weight model (tests/service_processes.py), one
engine: ``client.responses`` -> bridge -> router -> tokenizer / engine / usage. The
model's words are noise; these tests hold the shapes, that a stream adds up to the
whole answer, forced tool calls and their outputs, constrained JSON, stored
responses continued by ``previous_response_id`` as prefix-cache hits, and the
ledger's record of them. Each test leads its instructions with a fresh nonce, so
only turns meant to share a prefix do.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator

import httpx
import openai
import pytest
from service_processes import ENGINE_SERVER_BUILT, TINY_MODEL_ID, CachetStack

from cachet.bridge.responses_schemas import ResponseObject
from cachet.models.tiny import write_tiny_model

from .test_end_to_end import TIMEOUT, Platform

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12}, "days": {"type": "integer"}},
    "required": ["city", "days"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "name": "get_weather", "description": "Weather forecast.", "parameters": WEATHER},
    {
        "type": "function",
        "name": "get_time",
        "description": "The current time.",
        "parameters": {"type": "object"},
    },
]
GREEDY = {"max_output_tokens": 6, "temperature": 0}
QUESTION = "What is the weather in Paris for the next two days?"


@pytest.fixture(scope="module")
def platform(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Platform]:
    if not ENGINE_SERVER_BUILT:
        pytest.skip("the engine server (cachet.engine.main) is not built yet")
    root = tmp_path_factory.mktemp("responses-e2e")
    stack = CachetStack(root, write_tiny_model(root / TINY_MODEL_ID)).start(engines=1)
    try:
        yield Platform(stack, stack.start_bridge(CACHET_DATA_DIR=str(root / "bridge-data")))
    finally:
        stack.stop()
        print(stack.logs())


def instructions() -> str:
    # Long enough to fill whole 16-token blocks, so a follow-up reads them from the cache.
    return f"[{uuid.uuid4().hex}] You are a terse weather assistant. Answer in one short sentence, no more."


def check(response: openai.types.responses.Response) -> dict:
    """The response as JSON, held to the bridge's declared shape."""
    data = response.model_dump(mode="json", exclude_unset=True)
    ResponseObject.model_validate(data)
    return data


def test_previous_response_id_continues_from_the_cache_and_is_billed(platform: Platform) -> None:
    client, prompt = platform.client(), instructions()
    first = client.responses.create(model=TINY_MODEL_ID, instructions=prompt, input=QUESTION, **GREEDY)
    check(first)
    assert first.id.startswith("resp_") and first.object == "response"
    assert first.status in ("completed", "incomplete")
    assert [item.type for item in first.output] == ["message"]
    assert first.output_text and 1 <= first.usage.output_tokens <= 6
    # Instructions are not carried over (as at OpenAI): an agent sends its own every turn.
    follow_up = client.responses.create(
        model=TINY_MODEL_ID,
        instructions=prompt,
        previous_response_id=first.id,
        input=[{"role": "user", "content": [{"type": "input_text", "text": "And in Lyon?"}]}],
        **GREEDY,
    )
    check(follow_up)
    assert follow_up.previous_response_id == first.id
    # The stored conversation was resent under its session, to the replica that holds it:
    # the first turn's whole blocks are a prefix-cache hit.
    assert follow_up.usage.input_tokens > first.usage.input_tokens
    assert follow_up.usage.input_tokens_details.cached_tokens >= (first.usage.input_tokens - 1) // 16 * 16 > 0
    # Stored: GET answers it as it was, input_items lists the whole conversation.
    assert client.responses.retrieve(first.id).model_dump() == first.model_dump()
    items = client.responses.input_items.list(follow_up.id, order="asc")
    kinds = [(item.type, getattr(item, "role", None)) for item in items.data]
    assert kinds == [("message", "user"), ("message", "assistant"), ("message", "user")]
    # Billed by the same ledger as chat, under the session the conversation started.
    expected = {
        "requests": 2,
        "prompt_tokens": first.usage.input_tokens + follow_up.usage.input_tokens,
        "cached_tokens": first.usage.input_tokens_details.cached_tokens
        + follow_up.usage.input_tokens_details.cached_tokens,
        "completion_tokens": first.usage.output_tokens + follow_up.usage.output_tokens,
    }
    assert ledger(platform, first.id) == expected


def ledger(platform: Platform, session: str) -> dict:
    """The session's row of /v1/usage, once the router's recorder has sent both records."""
    deadline, row = time.monotonic() + 30, {}
    while time.monotonic() < deadline:
        params = {"session": session, "group_by": "session"}
        rows = httpx.get(f"{platform.url}/v1/usage", params=params, timeout=TIMEOUT).json()["data"]
        keys = ("requests", "prompt_tokens", "cached_tokens", "completion_tokens")
        row = {key: rows[0][key] for key in keys} if rows else {}
        if row.get("requests") == 2:
            return row
        time.sleep(0.2)
    return row


def test_stream_adds_up_to_the_whole_answer_and_is_stored(platform: Platform) -> None:
    client, prompt = platform.client(), instructions()
    whole = client.responses.create(model=TINY_MODEL_ID, instructions=prompt, input=QUESTION, **GREEDY)
    events = list(
        client.responses.create(
            model=TINY_MODEL_ID, instructions=prompt, input=QUESTION, stream=True, **GREEDY
        )
    )
    kinds = [event.type for event in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed" if whole.status == "completed" else "response.incomplete",
    ]
    assert [event.sequence_number for event in events] == list(range(len(events)))
    text = "".join(event.delta for event in events if event.type == "response.output_text.delta")
    assert text == whole.output_text
    final = events[-1].response
    assert final.output_text == whole.output_text
    assert final.usage.input_tokens == whole.usage.input_tokens
    assert final.usage.input_tokens_details.cached_tokens > 0
    assert client.responses.retrieve(final.id).output_text == whole.output_text


def forced_call(response: openai.types.responses.Response) -> openai.types.responses.ResponseFunctionToolCall:
    calls = [item for item in response.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather", response
    arguments = json.loads(calls[0].arguments)
    assert set(arguments) == {"city", "days"} and isinstance(arguments["days"], int)
    return calls[0]


def test_forced_tool_call_then_its_output_as_a_follow_up(platform: Platform) -> None:
    client = platform.client()
    # Sampled, not greedy (greedy random weights pad JSON with whitespace to the limit):
    # whatever the model picks, the grammar keeps the call valid.
    forced = {
        "tools": TOOLS,
        "tool_choice": {"type": "function", "name": "get_weather"},
        "parallel_tool_calls": False,
        "max_output_tokens": 120,
        "temperature": 1.0,
    }
    prompt = instructions()
    whole = client.responses.create(model=TINY_MODEL_ID, instructions=prompt, input=QUESTION, **forced)
    call = forced_call(whole)
    streamed = list(
        client.responses.create(
            model=TINY_MODEL_ID, instructions=instructions(), input=QUESTION, stream=True, **forced
        )
    )
    done = [e for e in streamed if e.type == "response.function_call_arguments.done"]
    assert len(done) == 1 and done[0].name == "get_weather"
    deltas = "".join(e.delta for e in streamed if e.type == "response.function_call_arguments.delta")
    assert deltas == done[0].arguments
    forced_call(streamed[-1].response)
    answer = client.responses.create(
        model=TINY_MODEL_ID,
        instructions=prompt,
        previous_response_id=whole.id,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": '{"forecast": "sun"}'}],
        tools=TOOLS,
        # Sampled like the first turn, whose cached blocks it reads (greedy turns name their KV apart).
        max_output_tokens=6,
        temperature=1.0,
    )
    assert answer.usage.input_tokens > whole.usage.input_tokens
    # The first turn's whole blocks come from the cache.
    assert answer.usage.input_tokens_details.cached_tokens >= (whole.usage.input_tokens - 1) // 16 * 16 > 0


def test_json_schema_text_format_is_enforced(platform: Platform) -> None:
    client = platform.client()
    constrained = {
        "model": TINY_MODEL_ID,
        "input": QUESTION,
        "text": {"format": {"type": "json_schema", "name": "weather", "schema": WEATHER, "strict": True}},
        "max_output_tokens": 120,
        "temperature": 1.0,
        "store": False,
    }
    response = client.responses.create(**constrained)
    assert response.status == "completed", response
    answer = json.loads(response.output_text)
    assert set(answer) == {"city", "days"} and isinstance(answer["days"], int)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(response.id)
    # The SDK's stream helper accumulates the events into the same shape.
    with client.responses.stream(**constrained) as stream:
        final = stream.get_final_response()
    assert set(json.loads(final.output_text)) == {"city", "days"}


def test_delete_and_errors_through_the_sdk(platform: Platform) -> None:
    client = platform.client()
    stored = client.responses.create(model=TINY_MODEL_ID, input=QUESTION, max_output_tokens=1)
    client.responses.delete(stored.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(stored.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(stored.id)
    with pytest.raises(openai.BadRequestError, match="Previous response") as gone:
        client.responses.create(model=TINY_MODEL_ID, input="Hi", previous_response_id=stored.id)
    assert gone.value.body["param"] == "previous_response_id"
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="no-such-model", input="Hi")
    with pytest.raises(openai.BadRequestError, match="background"):
        client.responses.create(model=TINY_MODEL_ID, input="Hi", background=True)
    with pytest.raises(openai.BadRequestError, match="web_search"):
        client.responses.create(model=TINY_MODEL_ID, input="Hi", tools=[{"type": "web_search"}])
    # The router's own refusal (a prompt over the context window), OpenAI-shaped.
    with pytest.raises(openai.BadRequestError, match="context window"):
        client.responses.create(model=TINY_MODEL_ID, input="hi " * 2500)


def test_a_chain_keeps_the_session_it_started_under(platform: Platform) -> None:
    session = f"s-{uuid.uuid4().hex}"
    pinned = openai.OpenAI(
        base_url=f"{platform.url}/v1",
        api_key="dev",
        max_retries=0,
        timeout=TIMEOUT,
        default_headers={"x-session-affinity": session},
    )
    first = pinned.responses.create(model=TINY_MODEL_ID, input=QUESTION, max_output_tokens=1)
    # The follow-up names no session: it runs, and is billed, under the one its chain began with.
    platform.client().responses.create(
        model=TINY_MODEL_ID, previous_response_id=first.id, input="And tomorrow?", max_output_tokens=1
    )
    assert ledger(platform, session)["requests"] == 2
