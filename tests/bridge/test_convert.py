"""REST JSON <-> router protos, exactly; and every JSON produced matches its declared response model."""

from __future__ import annotations

import json

import pytest

from cachet.bridge import convert, schemas
from cachet.common.v1 import common_pb2
from cachet.router.v1 import router_pb2
from cachet.usage.v1 import usage_pb2

WEATHER_SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}


def chat_body(**fields: object) -> schemas.ChatCompletionBody:
    return schemas.ChatCompletionBody.model_validate(
        {"model": "smollm2", "messages": [{"role": "user", "content": "hi"}]} | fields
    )


def test_chat_request_every_field() -> None:
    body = chat_body(
        messages=[
            {"role": "system", "content": "be brief"},
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "what is this?"},
                    {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
                ],
            },
            {
                "role": "assistant",
                "content": None,
                "reasoning_content": "need the weather",
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "weather", "arguments": '{"city":"Paris"}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny", "name": "weather"},
        ],
        tools=[
            {
                "type": "function",
                "function": {
                    "name": "weather",
                    "description": "Weather now",
                    "parameters": WEATHER_SCHEMA,
                    "strict": True,
                },
            }
        ],
        tool_choice={"type": "function", "function": {"name": "weather"}},
        parallel_tool_calls=False,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "answer", "schema": WEATHER_SCHEMA, "strict": True},
        },
        temperature=0.5,
        top_p=0.25,
        max_tokens=100,
        max_completion_tokens=50,
        seed=7,
        stop="END",
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        logprobs=True,
        top_logprobs=3,
        n=1,
        user="u-1",
        stream=True,
        stream_options={"include_usage": True},
    )
    expected = router_pb2.ChatCompletionRequest(
        model="smollm2",
        messages=[
            common_pb2.ChatMessage(role="system", content=[common_pb2.ContentPart(text="be brief")]),
            common_pb2.ChatMessage(
                role="user",
                content=[
                    common_pb2.ContentPart(text="what is this?"),
                    common_pb2.ContentPart(image_url="data:image/png;base64,AAAA"),
                ],
            ),
            common_pb2.ChatMessage(
                role="assistant",
                reasoning_content="need the weather",
                tool_calls=[
                    common_pb2.ToolCall(id="call_1", name="weather", arguments_json='{"city":"Paris"}')
                ],
            ),
            common_pb2.ChatMessage(
                role="tool",
                tool_call_id="call_1",
                name="weather",
                content=[common_pb2.ContentPart(text="sunny")],
            ),
        ],
        sampling=common_pb2.SamplingParams(
            temperature=0.5,
            top_p=0.25,
            # max_completion_tokens wins over max_tokens, as in OpenAI's API.
            max_tokens=50,
            seed=7,
            stop=["END"],
            presence_penalty=0.5,
            frequency_penalty=-0.5,
            logprobs=True,
            top_logprobs=3,
        ),
        tools=[
            common_pb2.Tool(
                name="weather",
                description="Weather now",
                parameters_schema_json=json.dumps(WEATHER_SCHEMA, separators=(",", ":")),
                strict=True,
            )
        ],
        tool_choice=common_pb2.ToolChoice(function_name="weather"),
        response_format=common_pb2.ResponseFormat(
            json_schema=common_pb2.JsonSchemaFormat(
                name="answer", schema_json=json.dumps(WEATHER_SCHEMA, separators=(",", ":")), strict=True
            )
        ),
        parallel_tool_calls=False,
    )
    assert convert.chat_request_to_proto(body) == expected


def test_chat_request_leaves_unset_sampling_unset() -> None:
    request = convert.chat_request_to_proto(chat_body())
    # Unset optional fields mean "the default" to the router; 0 would mean greedy / no tokens.
    for name in ("temperature", "top_p", "seed", "max_tokens", "repetition_penalty"):
        assert not request.sampling.HasField(name), name
    assert not request.HasField("tool_choice")
    assert not request.HasField("response_format")
    assert not request.HasField("parallel_tool_calls")


@pytest.mark.parametrize(
    ("choice", "expected"),
    [
        ("none", common_pb2.ToolChoice(mode=common_pb2.TOOL_CHOICE_MODE_NONE)),
        ("auto", common_pb2.ToolChoice(mode=common_pb2.TOOL_CHOICE_MODE_AUTO)),
        ("required", common_pb2.ToolChoice(mode=common_pb2.TOOL_CHOICE_MODE_REQUIRED)),
    ],
)
def test_tool_choice_modes(choice: str, expected: common_pb2.ToolChoice) -> None:
    assert convert.chat_request_to_proto(chat_body(tool_choice=choice)).tool_choice == expected


@pytest.mark.parametrize(
    ("response_format", "expected"),
    [
        ({"type": "text"}, common_pb2.ResponseFormat(text=common_pb2.TextFormat())),
        ({"type": "json_object"}, common_pb2.ResponseFormat(json_object=common_pb2.JsonObjectFormat())),
        ({"type": "regex", "regex": "[0-9]+"}, common_pb2.ResponseFormat(regex="[0-9]+")),
        ({"type": "ebnf", "ebnf": 'root ::= "a"'}, common_pb2.ResponseFormat(ebnf='root ::= "a"')),
    ],
)
def test_response_formats(response_format: dict, expected: common_pb2.ResponseFormat) -> None:
    assert (
        convert.chat_request_to_proto(chat_body(response_format=response_format)).response_format == expected
    )


def test_stop_list_and_tool_without_parameters() -> None:
    request = convert.chat_request_to_proto(
        chat_body(stop=["a", "b"], tools=[{"type": "function", "function": {"name": "now"}}])
    )
    assert list(request.sampling.stop) == ["a", "b"]
    # A function without parameters takes no arguments: an empty object schema.
    assert request.tools[0].parameters_schema_json == '{"type":"object","properties":{}}'


def test_completion_requests() -> None:
    body = schemas.CompletionBody.model_validate(
        {"model": "m", "prompt": ["Once upon"], "logprobs": 2, "stop": ["\n"], "seed": 3}
    )
    assert convert.completion_request_to_proto(body) == router_pb2.CompletionRequest(
        model="m",
        prompt="Once upon",
        # OpenAI's legacy default max_tokens is 16; logprobs=2 means two alternatives.
        sampling=common_pb2.SamplingParams(max_tokens=16, seed=3, stop=["\n"], logprobs=True, top_logprobs=2),
    )
    tokens = schemas.CompletionBody.model_validate({"model": "m", "prompt": [1, 2, 3], "max_tokens": 4})
    assert convert.completion_request_to_proto(tokens) == router_pb2.CompletionRequest(
        model="m", prompt_token_ids=[1, 2, 3], sampling=common_pb2.SamplingParams(max_tokens=4)
    )


def test_prompt_cache_key_is_the_session_the_router_places_by() -> None:
    assert convert.chat_request_to_proto(chat_body(prompt_cache_key="agent-7")).session_id == "agent-7"
    assert convert.chat_request_to_proto(chat_body()).session_id == ""
    text = schemas.CompletionBody.model_validate({"model": "m", "prompt": "a", "prompt_cache_key": "agent-7"})
    assert convert.completion_request_to_proto(text).session_id == "agent-7"


def test_cache_salt_passes_through_and_unset_stays_empty() -> None:
    assert convert.chat_request_to_proto(chat_body(cache_salt="run-7")).cache_salt == "run-7"
    assert convert.chat_request_to_proto(chat_body()).cache_salt == ""
    text = schemas.CompletionBody.model_validate({"model": "m", "prompt": "a", "cache_salt": "run-7"})
    assert convert.completion_request_to_proto(text).cache_salt == "run-7"


def test_workers_ai_prompt_is_one_user_turn_unless_raw() -> None:
    body = schemas.WorkersAIRunBody.model_validate({"prompt": "Tell me a joke", "temperature": 0.25})
    assert convert.workers_ai_request_to_proto("@cf/m", body) == router_pb2.ChatCompletionRequest(
        model="@cf/m",
        messages=[
            common_pb2.ChatMessage(role="user", content=[common_pb2.ContentPart(text="Tell me a joke")])
        ],
        # 256 is Workers AI's documented default max_tokens.
        sampling=common_pb2.SamplingParams(temperature=0.25, max_tokens=256),
    )
    raw = schemas.WorkersAIRunBody.model_validate({"prompt": "<s>[INST] hi", "raw": True, "max_tokens": 8})
    assert convert.workers_ai_request_to_proto("@cf/m", raw) == router_pb2.CompletionRequest(
        model="@cf/m", prompt="<s>[INST] hi", sampling=common_pb2.SamplingParams(max_tokens=8)
    )


def test_workers_ai_flat_tools_and_queue() -> None:
    body = schemas.WorkersAIBody.model_validate(
        {
            "requests": [
                {
                    "messages": [{"role": "user", "content": "a"}],
                    "tools": [{"name": "f", "parameters": WEATHER_SCHEMA}],
                },
                {"prompt": "b", "raw": True},
            ],
            "webhook_url": "https://example.test/hook",
        }
    )
    batch = convert.queue_request_to_proto("m", body)
    assert batch.model == "m" and batch.webhook_url == "https://example.test/hook"
    assert [r.WhichOneof("body") for r in batch.requests] == ["chat", "completion"]
    assert batch.requests[0].chat.tools[0] == common_pb2.Tool(
        name="f", parameters_schema_json=json.dumps(WEATHER_SCHEMA, separators=(",", ":"))
    )
    assert batch.requests[1].completion.prompt == "b"


USAGE = common_pb2.Usage(prompt_tokens=120, cached_tokens=96, completion_tokens=7)
USAGE_JSON = {
    "prompt_tokens": 120,
    "completion_tokens": 7,
    "total_tokens": 127,
    "prompt_tokens_details": {"cached_tokens": 96},
}


def completion(**fields: object) -> router_pb2.ChatCompletion:
    values: dict[str, object] = {
        "id": "chatcmpl-1",
        "model": "smollm2",
        "created": 1_700_000_000,
        "content": "Paris.",
        "finish_reason": common_pb2.FINISH_REASON_STOP,
        "usage": USAGE,
    }
    return router_pb2.ChatCompletion(**(values | fields))


def test_chat_completion_json() -> None:
    out = convert.chat_completion_to_json(completion())
    assert out == {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "created": 1_700_000_000,
        "model": "smollm2",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "Paris."},
                "logprobs": None,
                "finish_reason": "stop",
            }
        ],
        "usage": USAGE_JSON,
    }
    schemas.ChatCompletionResponse.model_validate(out)


def test_chat_completion_tool_calls_reasoning_logprobs() -> None:
    out = convert.chat_completion_to_json(
        completion(
            content="",
            reasoning_content="think",
            tool_calls=[common_pb2.ToolCall(id="call_9", name="weather", arguments_json='{"city":"Oslo"}')],
            finish_reason=common_pb2.FINISH_REASON_TOOL_CALLS,
            logprobs=[
                common_pb2.TokenLogprob(
                    token_id=5, logprob=-0.5, top=[common_pb2.TopLogprob(token_id=6, logprob=-1.0)]
                )
            ],
        )
    )
    choice = out["choices"][0]
    assert choice["message"] == {
        "role": "assistant",
        # A turn that is only tool calls has null content, as OpenAI sends it.
        "content": None,
        "reasoning_content": "think",
        "tool_calls": [
            {
                "id": "call_9",
                "type": "function",
                "function": {"name": "weather", "arguments": '{"city":"Oslo"}'},
            }
        ],
    }
    assert choice["finish_reason"] == "tool_calls"
    assert choice["logprobs"] == {
        "content": [
            {
                "token": "token_id:5",
                "logprob": -0.5,
                "bytes": None,
                "top_logprobs": [{"token": "token_id:6", "logprob": -1.0, "bytes": None}],
            }
        ]
    }
    schemas.ChatCompletionResponse.model_validate(out)


def test_cached_tokens_is_zero_not_null() -> None:
    out = convert.chat_completion_to_json(
        completion(usage=common_pb2.Usage(prompt_tokens=3, completion_tokens=1))
    )
    assert out["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    out = convert.chat_completion_to_json(router_pb2.ChatCompletion(id="x"))
    assert out["usage"] == {
        "prompt_tokens": 0,
        "completion_tokens": 0,
        "total_tokens": 0,
        "prompt_tokens_details": {"cached_tokens": 0},
    }


@pytest.mark.parametrize(
    ("reason", "text"),
    [
        (common_pb2.FINISH_REASON_UNSPECIFIED, None),
        (common_pb2.FINISH_REASON_STOP, "stop"),
        (common_pb2.FINISH_REASON_LENGTH, "length"),
        (common_pb2.FINISH_REASON_TOOL_CALLS, "tool_calls"),
        (common_pb2.FINISH_REASON_ABORT, "abort"),
        (common_pb2.FINISH_REASON_ERROR, "error"),
    ],
)
def test_every_finish_reason_has_a_name(reason: int, text: str | None) -> None:
    assert (
        convert.chat_completion_to_json(completion(finish_reason=reason))["choices"][0]["finish_reason"]
        == text
    )


HEAD = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 5, "model": "m"}


def chunk(**fields: object) -> router_pb2.ChatCompletionChunk:
    return router_pb2.ChatCompletionChunk(id="chatcmpl-1", model="m", created=5, **fields)


def test_chat_chunks_role_deltas_finish_and_usage() -> None:
    assert convert.chat_chunk_to_json(chunk(role="assistant"), include_usage=False) == [
        HEAD
        | {
            "choices": [
                {
                    "index": 0,
                    "delta": {"role": "assistant", "content": ""},
                    "logprobs": None,
                    "finish_reason": None,
                }
            ]
        }
    ]
    assert convert.chat_chunk_to_json(chunk(content_delta="Pa"), include_usage=True) == [
        HEAD
        | {
            "choices": [{"index": 0, "delta": {"content": "Pa"}, "logprobs": None, "finish_reason": None}],
            "usage": None,
        }
    ]
    last = chunk(finish_reason=common_pb2.FINISH_REASON_STOP, usage=USAGE)
    # With include_usage: the finishing chunk, then one with empty choices and the usage.
    assert convert.chat_chunk_to_json(last, include_usage=True) == [
        HEAD
        | {
            "choices": [{"index": 0, "delta": {}, "logprobs": None, "finish_reason": "stop"}],
            "usage": None,
        },
        HEAD | {"choices": [], "usage": USAGE_JSON},
    ]
    # Without it, usage is not sent at all.
    assert convert.chat_chunk_to_json(last, include_usage=False) == [
        HEAD | {"choices": [{"index": 0, "delta": {}, "logprobs": None, "finish_reason": "stop"}]}
    ]
    # A chunk with only usage yields nothing unless usage was asked for.
    assert convert.chat_chunk_to_json(chunk(usage=USAGE), include_usage=False) == []
    for event in convert.chat_chunk_to_json(last, include_usage=True):
        schemas.ChatCompletionChunkResponse.model_validate(event)


def test_tool_call_delta_fragments() -> None:
    first, rest = (
        router_pb2.ToolCallDelta(index=0, id="call_1", name="weather", arguments_delta='{"ci'),
        router_pb2.ToolCallDelta(index=0, arguments_delta='ty":"Rome"}'),
    )
    events = convert.chat_chunk_to_json(chunk(tool_call_deltas=[first, rest]), include_usage=False)
    # One tool-call delta per event, as OpenAI streams them.
    assert [event["choices"][0]["delta"] for event in events] == [
        {
            "tool_calls": [
                {
                    "index": 0,
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "weather", "arguments": '{"ci'},
                }
            ]
        },
        {"tool_calls": [{"index": 0, "function": {"arguments": 'ty":"Rome"}'}}]},
    ]
    for event in events:
        schemas.ChatCompletionChunkResponse.model_validate(event)


def test_text_completion_json_and_chunks() -> None:
    out = convert.text_completion_to_json(
        completion(
            id="cmpl-1",
            content=" there",
            finish_reason=common_pb2.FINISH_REASON_LENGTH,
            logprobs=[
                common_pb2.TokenLogprob(
                    token_id=1, logprob=-0.25, top=[common_pb2.TopLogprob(token_id=2, logprob=-2.0)]
                )
            ],
        )
    )
    assert out == {
        "id": "cmpl-1",
        "object": "text_completion",
        "created": 1_700_000_000,
        "model": "smollm2",
        "choices": [
            {
                "index": 0,
                "text": " there",
                "logprobs": {
                    "tokens": ["token_id:1"],
                    "token_logprobs": [-0.25],
                    "top_logprobs": [{"token_id:2": -2.0}],
                },
                "finish_reason": "length",
            }
        ],
        "usage": USAGE_JSON,
    }
    schemas.TextCompletionResponse.model_validate(out)
    events = convert.text_chunk_to_json(chunk(content_delta=" t", usage=USAGE), include_usage=True)
    assert events == [
        {
            "id": "chatcmpl-1",
            "object": "text_completion",
            "created": 5,
            "model": "m",
            "choices": [{"index": 0, "text": " t", "logprobs": None, "finish_reason": None}],
            "usage": None,
        },
        {
            "id": "chatcmpl-1",
            "object": "text_completion",
            "created": 5,
            "model": "m",
            "choices": [],
            "usage": USAGE_JSON,
        },
    ]
    for event in events:
        schemas.TextCompletionResponse.model_validate(event)


def test_a_text_streams_first_chunk_makes_an_event_before_any_text() -> None:
    # The router's first chunk goes with the first token, text or not: the client sees it begin.
    [event] = convert.text_chunk_to_json(chunk(), include_usage=False)
    assert event["choices"] == [{"index": 0, "text": "", "logprobs": None, "finish_reason": None}]
    schemas.TextCompletionResponse.model_validate(event)


def test_workers_ai_result_and_stream_events() -> None:
    out = convert.workers_ai_result_to_json(
        completion(tool_calls=[common_pb2.ToolCall(id="c", name="f", arguments_json="{}")])
    )
    assert out == {
        "result": {
            "response": "Paris.",
            "usage": USAGE_JSON,
            "tool_calls": [{"name": "f", "arguments": {}}],
        },
        "success": True,
        "errors": [],
        "messages": [],
    }
    schemas.WorkersAIResponse.model_validate(out)
    assert convert.workers_ai_chunk_to_json(chunk(role="assistant")) == []
    assert convert.workers_ai_chunk_to_json(chunk(content_delta="Pa")) == [{"response": "Pa"}]
    last = convert.workers_ai_chunk_to_json(chunk(finish_reason=common_pb2.FINISH_REASON_STOP, usage=USAGE))
    assert last == [{"response": "", "usage": USAGE_JSON}]
    schemas.WorkersAIStreamEvent.model_validate(last[0])


def test_queued_batch_json() -> None:
    batch = router_pb2.QueuedBatch(
        request_id="batch-1",
        status=router_pb2.BATCH_STATUS_DONE,
        results=[
            router_pb2.QueuedResult(completion=completion()),
            router_pb2.QueuedResult(
                error=router_pb2.RequestError(code="INVALID_ARGUMENT", message="too long")
            ),
        ],
    )
    out = convert.queued_batch_to_json(batch)
    assert out["result"] == {
        "request_id": "batch-1",
        "status": "done",
        "responses": [
            {"id": 0, "success": True, "result": {"response": "Paris.", "usage": USAGE_JSON}, "errors": []},
            {"id": 1, "success": False, "errors": [{"code": 0, "message": "INVALID_ARGUMENT: too long"}]},
        ],
    }
    schemas.WorkersAIResponse.model_validate(out)
    queued = convert.queued_batch_to_json(router_pb2.QueuedBatch(request_id="b", status=1), model="m")
    assert queued["result"] == {"request_id": "b", "status": "queued", "model": "m"}


def test_models_and_usage_report_json() -> None:
    models = router_pb2.ListModelsResponse(
        models=[router_pb2.ModelCard(id="smollm2", context_window=8192, created=9, owned_by="")]
    )
    out = convert.models_to_json(models)
    assert out == {
        "object": "list",
        "data": [
            {"id": "smollm2", "object": "model", "created": 9, "owned_by": "cachet", "context_window": 8192}
        ],
    }
    schemas.ModelList.model_validate(out)
    report = usage_pb2.QueryUsageResponse(
        rows=[
            usage_pb2.UsageRow(
                model="m",
                day="2026-03-01",
                requests=2,
                prompt_tokens=1_000_000,
                cached_tokens=500_000,
                completion_tokens=10,
                cost_picousd=350_030_000_000,
                cache_savings_picousd=250_000_000_000,
            )
        ]
    )
    out = convert.usage_report_to_json(report)
    assert out["data"] == [
        {
            "account_id": None,
            "model": "m",
            "day": "2026-03-01",
            "session_id": None,
            "requests": 2,
            "prompt_tokens": 1_000_000,
            "cached_tokens": 500_000,
            "completion_tokens": 10,
            "cost_picousd": 350_030_000_000,
            "cost_usd": "0.350030000000",
            "cache_savings_picousd": 250_000_000_000,
        }
    ]
    schemas.UsageReport.model_validate(out)
