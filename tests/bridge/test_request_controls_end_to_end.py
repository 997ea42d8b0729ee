"""Reasoning controls, n choices and oneOf schemas through the whole platform (issue 28).

REST -> bridge -> router -> tokenizer / engines, all real processes.

Real processes on the tiny model, whose tokenizer carries a Qwen3-style template: it reads
``enable_thinking`` (thinking off writes an empty think block into the prompt, which the
prompt's token count shows) and nothing else a control could set. Two engines, so that the
choices of one request could land apart if the router let them.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from service_processes import ENGINE_SERVER_BUILT, TINY_MODEL_ID, CachetStack, ServiceProcess

from cachet.models.tiny import write_tiny_model

TIMEOUT = 120.0
THINKING_TEMPLATE = """\
{%- for message in messages %}
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}
{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}
{%- endif %}
"""


@dataclass
class Platform:
    stack: CachetStack
    bridge: ServiceProcess

    @property
    def url(self) -> str:
        return f"http://{self.bridge.address}"

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="dev", max_retries=0, timeout=TIMEOUT)

    def post(self, path: str, body: dict[str, Any]) -> httpx.Response:
        return httpx.post(f"{self.url}{path}", json=body, timeout=TIMEOUT)


def _with_thinking_template(model_dir: Path) -> Path:
    config_path = model_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = THINKING_TEMPLATE
    config_path.write_text(json.dumps(config))
    return model_dir


@pytest.fixture(scope="module")
def platform(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Platform]:
    if not ENGINE_SERVER_BUILT:
        pytest.skip("the engine server (cachet.engine.main) is not built yet")
    root = tmp_path_factory.mktemp("reasoning-choices-e2e")
    model_dir = _with_thinking_template(write_tiny_model(root / TINY_MODEL_ID))
    stack = CachetStack(root, model_dir).start(engines=2)
    try:
        yield Platform(stack, stack.start_bridge(CACHET_BRIDGE_TOKENIZER_ADDRESS=stack.address("tokenizer")))
    finally:
        stack.stop()
        print(stack.logs())


def chat(question: str = "What is the capital of France?", **fields: Any) -> dict[str, Any]:
    # A fresh nonce: no other test's prefix is cached. Long enough for a few whole 16-token blocks.
    system = (
        f"[{uuid.uuid4().hex}] You are a terse assistant. Answer in one short sentence, no more than that."
    )
    return {
        "model": TINY_MODEL_ID,
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}],
        "max_tokens": 4,
        "ignore_eos": True,
    } | fields


def _log_lines(process: ServiceProcess, event: str) -> list[dict[str, Any]]:
    lines = []
    for line in process.log_path.read_text().splitlines():
        if line.startswith("{"):
            record = json.loads(line)
            if record.get("event") == event:
                lines.append(record)
    return lines


# ---------------------------------------------------------------- reasoning controls


def test_thinking_and_chat_template_kwargs_reach_the_template(platform: Platform) -> None:
    body = chat()
    plain = platform.post("/v1/chat/completions", body).json()["usage"]["prompt_tokens"]
    kwargs = platform.post(
        "/v1/chat/completions", body | {"chat_template_kwargs": {"enable_thinking": False}}
    )
    thinking = platform.post("/v1/chat/completions", body | {"thinking": {"type": "disabled"}})
    on = platform.post(
        "/v1/chat/completions", body | {"thinking": {"type": "enabled", "budget_tokens": 2048}}
    )
    assert (kwargs.status_code, thinking.status_code, on.status_code) == (200, 200, 200)
    # Thinking off writes an empty think block into the prompt; on (the template's default) does not.
    assert kwargs.json()["usage"]["prompt_tokens"] > plain
    assert thinking.json()["usage"]["prompt_tokens"] == kwargs.json()["usage"]["prompt_tokens"]
    assert on.json()["usage"]["prompt_tokens"] == plain


def test_anthropics_thinking_switch_is_the_same_control(platform: Platform) -> None:
    body = {
        "model": TINY_MODEL_ID,
        "messages": [{"role": "user", "content": f"[{uuid.uuid4().hex}] Hello there"}],
    }
    plain = platform.post("/v1/messages/count_tokens", body)
    off = platform.post("/v1/messages/count_tokens", body | {"thinking": {"type": "disabled"}})
    assert (plain.status_code, off.status_code) == (200, 200)
    assert off.json()["input_tokens"] > plain.json()["input_tokens"]
    answer = platform.post("/v1/messages", body | {"max_tokens": 2, "thinking": {"type": "disabled"}})
    assert answer.status_code == 200, answer.text
    assert answer.json()["usage"]["input_tokens"] == off.json()["input_tokens"]


@pytest.mark.parametrize(
    ("path", "fields", "param"),
    [
        ("/v1/chat/completions", {"reasoning_effort": "high"}, "reasoning_effort"),
        (
            "/v1/chat/completions",
            {"chat_template_kwargs": {"thinking_budget": 5}},
            "chat_template_kwargs.thinking_budget",
        ),
        ("/v1/responses", {"reasoning": {"effort": "low"}}, "reasoning_effort"),
    ],
)
def test_a_control_the_template_does_not_read_is_a_400_naming_it(
    platform: Platform, path: str, fields: dict[str, Any], param: str
) -> None:
    base = (
        chat() if path == "/v1/chat/completions" else {"model": TINY_MODEL_ID, "input": "Hi", "store": False}
    )
    response = platform.post(path, base | fields)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param
    assert "does not read" in error["message"]


def test_anthropic_effort_the_template_does_not_read_is_an_anthropic_400(platform: Platform) -> None:
    body = {
        "model": TINY_MODEL_ID,
        "max_tokens": 2,
        "messages": [{"role": "user", "content": "Hi"}],
        "output_config": {"effort": "high"},
    }
    response = platform.post("/v1/messages", body)
    assert response.status_code == 400, response.text
    assert response.json()["type"] == "error"
    assert response.json()["error"]["type"] == "invalid_request_error"
    assert "reasoning_effort" in response.json()["error"]["message"]


def test_an_unsupported_openai_field_is_refused_and_a_vendor_field_logged(platform: Platform) -> None:
    refused = platform.post("/v1/chat/completions", chat(logit_bias={"42": 5}))
    assert refused.status_code == 400
    assert refused.json()["error"]["param"] == "logit_bias"
    vendor = f"vendor_field_{uuid.uuid4().hex[:8]}"
    accepted = platform.post("/v1/chat/completions", chat(**{vendor: {"x": 1}, "store": False}))
    assert accepted.status_code == 200, accepted.text
    ignored = _log_lines(platform.bridge, "unknown fields ignored")
    assert any(line["fields"] == [vendor] for line in ignored), ignored


# ---------------------------------------------------------------- n choices


def test_n_choices_share_one_prefill_on_one_replica_and_bill_the_prompt_once(platform: Platform) -> None:
    body = chat(n=3, temperature=1.0, seed=7, max_tokens=5)
    single = platform.post("/v1/chat/completions", chat(max_tokens=5, messages=body["messages"]))
    answer = platform.client().chat.completions.create(**_sdk(body))
    assert [c.index for c in answer.choices] == [0, 1, 2]
    assert all(c.finish_reason == "length" for c in answer.choices)
    # Seeds differ per choice (seed + index), so the choices are not one answer three times.
    assert len({c.message.content for c in answer.choices}) > 1
    usage = answer.usage
    assert usage.prompt_tokens == single.json()["usage"]["prompt_tokens"]
    assert usage.completion_tokens == 15
    assert usage.total_tokens == usage.prompt_tokens + 15
    # Each choice is its own engine request; all on one replica, the others prefix-cache hits
    # of what choice 0 computed (every full block of the prompt, so at least one).
    done = _wait_for_log(platform, answer.id, 3)
    assert len({line["replica"] for line in done}) == 1, done
    block = 16
    full = (usage.prompt_tokens - 1) // block * block
    followers = [line for line in done if line["choice"] > 0]
    assert full > 0 and all(line["cached_tokens"] >= full for line in followers), done


def test_streamed_choices_carry_their_index_and_usage_comes_once(platform: Platform) -> None:
    body = chat(n=2, max_tokens=3, stream=True, stream_options={"include_usage": True})
    chunks = list(platform.client().chat.completions.create(**_sdk(body)))
    with_choices = [c for c in chunks if c.choices]
    assert {c.choices[0].index for c in with_choices} == {0, 1}
    for index in (0, 1):
        mine = [c.choices[0] for c in with_choices if c.choices[0].index == index]
        assert mine[0].delta.role == "assistant"
        assert [c.finish_reason for c in mine if c.finish_reason] == ["length"]
    usage = [c.usage for c in chunks if c.usage is not None]
    assert len(usage) == 1 and chunks[-1].usage is not None
    assert usage[0].completion_tokens == 6


def test_a_stop_string_ends_each_choice_before_it_streamed_or_whole(platform: Platform) -> None:
    # Seeded: the stopped choices sample what the unstopped ones did, up to the stop string.
    body = chat(n=2, temperature=1.0, seed=41, max_tokens=16)
    texts = [c.message.content or "" for c in platform.client().chat.completions.create(**_sdk(body)).choices]
    assert len(texts[1]) >= 4, texts
    stop = texts[1][len(texts[1]) // 2 : len(texts[1]) // 2 + 2]
    expected = [(t[: t.find(stop)], "stop") if stop in t else (t, "length") for t in texts]
    whole = platform.client().chat.completions.create(**_sdk(body | {"stop": [stop]}))
    assert [(c.message.content or "", c.finish_reason) for c in whole.choices] == expected
    stream = platform.client().chat.completions.create(**_sdk(body | {"stop": [stop], "stream": True}))
    deltas = [chunk.choices[0] for chunk in stream if chunk.choices]
    streamed = []
    for index in (0, 1):
        mine = [delta for delta in deltas if delta.index == index]
        streamed.append(("".join(delta.delta.content or "" for delta in mine), mine[-1].finish_reason))
    assert streamed == expected


def test_text_completions_take_n_too(platform: Platform) -> None:
    prompt = f"[{uuid.uuid4().hex}] Once upon a time, in a land far away, there lived a"
    body = {"model": TINY_MODEL_ID, "prompt": prompt, "n": 2, "max_tokens": 3, "ignore_eos": True}
    answer = platform.post("/v1/completions", body)
    assert answer.status_code == 200, answer.text
    assert [c["index"] for c in answer.json()["choices"]] == [0, 1]
    assert answer.json()["usage"]["completion_tokens"] == 6


def test_usage_ledger_counts_the_request_once(platform: Platform) -> None:
    session = f"n-{uuid.uuid4().hex}"
    platform.post("/v1/chat/completions", chat(n=4, max_tokens=2, prompt_cache_key=session))
    deadline = time.monotonic() + 30
    rows: list[dict[str, Any]] = []
    while time.monotonic() < deadline:
        data = httpx.get(f"{platform.url}/v1/usage", params={"group_by": "session"}, timeout=TIMEOUT).json()
        rows = [row for row in data["data"] if row["session_id"] == session]
        if rows:
            break
        time.sleep(0.2)
    assert len(rows) == 1 and rows[0]["requests"] == 1
    assert rows[0]["completion_tokens"] == 8


def _sdk(body: dict[str, Any]) -> dict[str, Any]:
    """The body as the openai SDK's arguments (its own fields, the rest as extra_body)."""
    own = {"model", "messages", "n", "temperature", "seed", "max_tokens", "stream", "stream_options"}
    return {k: v for k, v in body.items() if k in own} | {
        "extra_body": {k: v for k, v in body.items() if k not in own}
    }


def _wait_for_log(platform: Platform, request_id: str, count: int) -> list[dict[str, Any]]:
    deadline = time.monotonic() + 10
    while True:
        done = [
            line
            for line in _log_lines(platform.stack.processes["router"], "request done")
            if line.get("request_id") == request_id
        ]
        if len(done) >= count or time.monotonic() > deadline:
            return done
        time.sleep(0.1)


# ---------------------------------------------------------------- oneOf


PET = {
    "type": "object",
    "properties": {
        "pet": {
            "oneOf": [
                {
                    "type": "object",
                    "properties": {"cat": {"const": 1}},
                    "required": ["cat"],
                    "additionalProperties": False,
                },
                {
                    "type": "object",
                    "properties": {"dog": {"const": 2}},
                    "required": ["dog"],
                    "additionalProperties": False,
                },
            ]
        }
    },
    "required": ["pet"],
    "additionalProperties": False,
}
# The one answer the grammar allows ([7,7,7], several tokens, so a stream has sent text before the
# end) matches both alternatives: anyOf's, never oneOf's.
BOTH = {
    "oneOf": [
        {"type": "array", "items": {"const": 7}, "minItems": 3, "maxItems": 3},
        {"type": "array", "items": {"enum": [7]}, "minItems": 3, "maxItems": 3},
    ]
}


def _schema_format(schema: dict[str, Any], strict: bool = True) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": strict}}


@pytest.mark.parametrize("strict", [True, False])
def test_one_of_is_accepted_and_the_answer_matches_the_whole_schema(platform: Platform, strict: bool) -> None:
    body = chat(max_tokens=40, response_format=_schema_format(PET, strict)) | {"ignore_eos": False}
    response = platform.post("/v1/chat/completions", body)
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    assert choice["finish_reason"] == "stop"
    document = json.loads(choice["message"]["content"])
    assert document in ({"pet": {"cat": 1}}, {"pet": {"dog": 2}})


def test_an_answer_valid_for_more_than_one_alternative_is_an_error_the_client_sees(
    platform: Platform,
) -> None:
    body = chat(max_tokens=10, response_format=_schema_format(BOTH)) | {"ignore_eos": False}
    response = platform.post("/v1/chat/completions", body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "response_format.json_schema.schema"
    assert error["code"] == "answer_schema_mismatch"
    assert "valid under each of" in error["message"]
    # Streamed, the text went out already: the stream ends with the error, not with a finish.
    with httpx.stream(
        "POST", f"{platform.url}/v1/chat/completions", json=body | {"stream": True}, timeout=TIMEOUT
    ) as streamed:
        assert streamed.status_code == 200
        events = [line[6:] for line in streamed.iter_lines() if line.startswith("data: ")]
    assert any(json.loads(e).get("choices") for e in events if e != "[DONE]"), events
    finishes = [c["finish_reason"] for e in events if e != "[DONE]" for c in json.loads(e).get("choices", [])]
    assert not any(finishes)
    assert any("answer_schema_mismatch" in event for event in events), events


# ---------------------------------------------------------------- what the grammar leaves out

# The one answer the grammar allows is [7,7,7]: uniqueItems, which llguidance leaves out of the
# grammar (a non-strict schema compiles leniently), forbids it.
REPEATED = {"type": "array", "items": {"const": 7}, "minItems": 3, "maxItems": 3, "uniqueItems": True}
# Unknown formats decode as plain strings.
DATED = {
    "type": "object",
    "properties": {"when": {"type": "string", "format": "datetime", "maxLength": 6}},
    "required": ["when"],
    "additionalProperties": False,
}


def test_a_keyword_left_out_of_the_grammar_is_checked_and_refused_when_strict(platform: Platform) -> None:
    lenient = chat(max_tokens=10, response_format=_schema_format(REPEATED, strict=False)) | {
        "ignore_eos": False
    }
    response = platform.post("/v1/chat/completions", lenient)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["code"] == "answer_schema_mismatch"
    assert error["param"] == "response_format.json_schema.schema"
    assert "`uniqueItems`" in error["message"]
    strict = platform.post("/v1/chat/completions", lenient | {"response_format": _schema_format(REPEATED)})
    assert strict.status_code == 400, strict.text
    assert (
        'uses unsupported features: Unimplemented keys: ["uniqueItems"]' in strict.json()["error"]["message"]
    )


def test_an_unknown_format_decodes_as_a_string_unless_strict(platform: Platform) -> None:
    body = chat(max_tokens=30, response_format=_schema_format(DATED, strict=False)) | {"ignore_eos": False}
    response = platform.post("/v1/chat/completions", body)
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    assert choice["finish_reason"] == "stop"
    document = json.loads(choice["message"]["content"])
    assert list(document) == ["when"] and len(document["when"]) <= 6
    strict = platform.post("/v1/chat/completions", body | {"response_format": _schema_format(DATED)})
    assert strict.status_code == 400, strict.text
    assert "uses unsupported features: Unknown format: datetime" in strict.json()["error"]["message"]
