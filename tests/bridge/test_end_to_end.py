"""The whole platform through the bridge: the openai client -> bridge -> router -> tokenizer / engine / usage.

Real processes on the tiny model (tests/service_processes.py starts them);
one engine, to spare the two shared cores. Each test leads its prompt with a fresh
nonce, so only the tests that mean to share a cached prefix do.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import openai
import pytest
from metrics_scrape import scrape

# The router's tests own the process fixtures; a module path, not a conftest (see its docstring).
from service_processes import (
    ENGINE_SERVER_BUILT,
    TINY_MODEL_ID,
    CachetStack,
    ServiceProcess,
)

from cachet.models.tiny import write_tiny_model

from . import opencode_request

TIMEOUT = 120.0


@dataclass
class Platform:
    stack: CachetStack
    bridge: ServiceProcess

    @property
    def url(self) -> str:
        return f"http://{self.bridge.address}"

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="dev", max_retries=0, timeout=TIMEOUT)


@pytest.fixture(scope="module")
def platform(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Platform]:
    if not ENGINE_SERVER_BUILT:
        pytest.skip("the engine server (cachet.engine.main) is not built yet")
    root = tmp_path_factory.mktemp("bridge-e2e")
    stack = CachetStack(root, write_tiny_model(root / TINY_MODEL_ID)).start(engines=1)
    try:
        yield Platform(stack, stack.start_bridge())
    finally:
        stack.stop()
        print(stack.logs())


def messages(question: str = "What is the capital of France?") -> list[dict]:
    # Long enough to fill whole 16-token blocks, so a repeat can be served from the prefix cache.
    system = f"[{uuid.uuid4().hex}] You are a terse assistant. Answer in one short sentence, no more."
    return [{"role": "system", "content": system}, {"role": "user", "content": question}]


GREEDY = {"temperature": 0, "max_tokens": 6, "extra_body": {"ignore_eos": True}}


def block_retentions(platform: Platform) -> float:
    """KV blocks the engine has put under retention since it started."""
    figures = scrape(platform.stack.processes["engine0"].metrics_port, "cachet_engine_kv_block_retentions")
    return figures.get(("cachet_engine_kv_block_retentions_total", ()), 0.0)


def test_prompt_cache_retention_reaches_the_engine(platform: Platform) -> None:
    before = block_retentions(platform)
    # No retention asked and no session key (so no router default): nothing is retained.
    platform.client().chat.completions.create(model=TINY_MODEL_ID, messages=messages(), **GREEDY)
    assert block_retentions(platform) == before
    kept = platform.client().chat.completions.create(
        model=TINY_MODEL_ID,
        messages=messages(),
        temperature=0,
        max_tokens=6,
        extra_body={"ignore_eos": True, "prompt_cache_retention": "24h"},
    )
    # Every whole block the request computed: its prompt and its answer but the last token.
    assert block_retentions(platform) - before == (kept.usage.prompt_tokens + 6 - 1) // 16


def test_a_session_is_retained_by_default_unless_it_asks_none(platform: Platform) -> None:
    session = {"ignore_eos": True, "prompt_cache_key": f"key-{uuid.uuid4().hex}"}
    before = block_retentions(platform)
    # "none" (Cachet's opt-out) turns the router's default for sessions off.
    platform.client().chat.completions.create(
        model=TINY_MODEL_ID,
        messages=messages(),
        temperature=0,
        max_tokens=6,
        extra_body=session | {"prompt_cache_retention": "none"},
    )
    assert block_retentions(platform) == before
    kept = platform.client().chat.completions.create(
        model=TINY_MODEL_ID, messages=messages(), temperature=0, max_tokens=6, extra_body=session
    )
    assert block_retentions(platform) - before == (kept.usage.prompt_tokens + 6 - 1) // 16


def test_chat_completion_reports_usage_and_cached_tokens(platform: Platform) -> None:
    prompt = messages()
    first = platform.client().chat.completions.create(model=TINY_MODEL_ID, messages=prompt, **GREEDY)
    assert first.object == "chat.completion"
    assert first.choices[0].message.role == "assistant"
    assert first.choices[0].finish_reason == "length"
    assert first.usage.completion_tokens == 6
    assert first.usage.total_tokens == first.usage.prompt_tokens + 6
    # Present and a number even when nothing was cached.
    assert isinstance(first.usage.prompt_tokens_details.cached_tokens, int)
    again = platform.client().chat.completions.create(model=TINY_MODEL_ID, messages=prompt, **GREEDY)
    # The same prompt again is served from the prefix cache, and the response says so.
    assert again.usage.prompt_tokens_details.cached_tokens > 0
    assert again.choices[0].message.content == first.choices[0].message.content


def test_prompt_cache_key_is_the_session_and_the_header_wins(platform: Platform) -> None:
    keyed, header = f"key-{uuid.uuid4().hex}", f"header-{uuid.uuid4().hex}"
    client = platform.client()
    client.chat.completions.create(
        model=TINY_MODEL_ID, messages=messages(), extra_body={"prompt_cache_key": keyed}, **_greedy_body()
    )
    client.completions.create(
        model=TINY_MODEL_ID, prompt="Paris is", extra_body={"prompt_cache_key": keyed}, **_greedy_body()
    )
    client.chat.completions.create(
        model=TINY_MODEL_ID,
        messages=messages(),
        extra_body={"prompt_cache_key": keyed},
        extra_headers={"x-session-affinity": header},
        **_greedy_body(),
    )
    # The ledger is written in batches: wait for the three records, grouped by session.
    deadline = time.monotonic() + 30
    while True:
        rows = httpx.get(f"{platform.url}/v1/usage", params={"group_by": "session"}, timeout=TIMEOUT).json()
        sessions = {row["session_id"]: row["requests"] for row in rows["data"]}
        if sessions.get(keyed) == 2 and sessions.get(header) == 1 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert (sessions.get(keyed), sessions.get(header)) == (2, 1)


def _greedy_body() -> dict:
    return {"temperature": 0, "max_tokens": 2}


def test_streaming_with_include_usage_matches_the_plain_answer(platform: Platform) -> None:
    prompt = messages("Name a colour.")
    plain = platform.client().chat.completions.create(model=TINY_MODEL_ID, messages=prompt, **GREEDY)
    chunks = list(
        platform.client().chat.completions.create(
            model=TINY_MODEL_ID,
            messages=prompt,
            stream=True,
            stream_options={"include_usage": True},
            **GREEDY,
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == plain.choices[0].message.content
    finishing = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishing == ["length"]
    last = chunks[-1]
    assert last.choices == [] and last.usage is not None
    assert last.usage.completion_tokens == 6
    assert last.usage.prompt_tokens_details.cached_tokens >= 0
    assert all(c.usage is None for c in chunks[:-1])


def test_sse_framing_on_the_wire(platform: Platform) -> None:
    body = {
        "model": TINY_MODEL_ID,
        "messages": messages(),
        "stream": True,
        "max_tokens": 3,
        "ignore_eos": True,
    }
    with httpx.stream("POST", f"{platform.url}/v1/chat/completions", json=body, timeout=TIMEOUT) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        raw = response.read().decode()
    events = raw.split("\n\n")
    # Every event is one "data: " line; the stream ends with [DONE] and a blank line.
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    assert all(e.startswith("data: {") and "\n" not in e for e in events[:-2])


def test_completions_and_models(platform: Platform) -> None:
    client = platform.client()
    assert TINY_MODEL_ID in [m.id for m in client.models.list().data]
    # A model is listed, so a request can be served: ready.
    ready = httpx.get(f"{platform.url}/ready", timeout=5)
    assert (ready.status_code, ready.json()) == (200, {"status": "ok"})
    text = client.completions.create(model=TINY_MODEL_ID, prompt="Once upon a time", **GREEDY)
    assert text.object == "text_completion"
    assert text.usage.completion_tokens == 6 and text.choices[0].finish_reason == "length"


def test_workers_ai_run_plain_and_streamed(platform: Platform) -> None:
    body = {"messages": messages(), "max_tokens": 4, "temperature": 0}
    plain = httpx.post(f"{platform.url}/ai/run/{TINY_MODEL_ID}", json=body, timeout=TIMEOUT)
    assert plain.status_code == 200, plain.text
    out = plain.json()
    assert (out["success"], out["errors"], out["messages"]) == (True, [], [])
    assert isinstance(out["result"]["response"], str)
    assert out["result"]["usage"]["prompt_tokens_details"]["cached_tokens"] >= 0
    with httpx.stream(
        "POST", f"{platform.url}/ai/run/{TINY_MODEL_ID}", json=body | {"stream": True}, timeout=TIMEOUT
    ) as response:
        raw = response.read().decode()
    assert raw.endswith("data: [DONE]\n\n")
    assert '"usage"' in raw.split("\n\n")[-3]
    streamed = "".join(
        __import__("json").loads(e.removeprefix("data: "))["response"] for e in raw.split("\n\n")[:-2]
    )
    assert streamed == out["result"]["response"]


def _router_cancelled(platform: Platform) -> float:
    port = platform.stack.processes["router"].metrics_port
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    for line in text.splitlines():
        if line.startswith('cachet_router_requests_total{outcome="cancelled"}'):
            return float(line.split()[-1])
    return 0.0


def test_client_disconnect_cancels_the_request(platform: Platform) -> None:
    before = _router_cancelled(platform)
    body = {
        "model": TINY_MODEL_ID,
        "messages": messages(),
        "stream": True,
        "max_tokens": 1500,
        "ignore_eos": True,
    }
    with httpx.stream("POST", f"{platform.url}/v1/chat/completions", json=body, timeout=TIMEOUT) as response:
        first = next(response.iter_bytes())
        assert first.startswith(b'data: {"id"'), first
    # Leaving the block closed the connection mid-stream; the router must see its call cancelled.
    deadline = time.monotonic() + 30
    while _router_cancelled(platform) <= before:
        assert time.monotonic() < deadline, httpx.get(
            f"http://127.0.0.1:{platform.stack.processes['router'].metrics_port}/metrics", timeout=5
        ).text
        time.sleep(0.1)


def test_refusal_before_the_first_token_is_a_real_status(platform: Platform) -> None:
    # The router refuses (a prompt over the 2,048-token window) before any chunk: a 400, not a 200 stream.
    with pytest.raises(openai.BadRequestError) as refused:
        list(
            platform.client().chat.completions.create(
                model=TINY_MODEL_ID, messages=[{"role": "user", "content": "hi " * 2500}], stream=True
            )
        )
    assert refused.value.param == "messages"


def test_a_max_tokens_past_the_window_is_cut_to_fit(platform: Platform) -> None:
    # Agents send their own output limit (OpenCode: 32,000) whatever the model's window.
    answer = platform.client().chat.completions.create(
        model=TINY_MODEL_ID,
        messages=[{"role": "user", "content": "hi " * 1900}],
        max_tokens=32_000,
        extra_body={"ignore_eos": True},
    )
    assert answer.choices[0].finish_reason == "length"
    assert answer.usage.prompt_tokens + answer.usage.completion_tokens == 2048


def opencode_turn(platform: Platform, session: str, nonce: str, question: str) -> tuple[list[dict], dict]:
    """One OpenCode turn: the streamed chunks, and the usage its last chunk carries."""
    request = opencode_request.body(TINY_MODEL_ID, nonce, question)
    with httpx.stream(
        "POST",
        f"{platform.url}/v1/chat/completions",
        headers=opencode_request.headers(session),
        json=request,
        timeout=TIMEOUT,
    ) as response:
        assert response.status_code == 200, response.read()
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(event) for event in events[:-1]]
    # include_usage: one last chunk with the usage and no choices, after every choice chunk.
    assert chunks[-1]["choices"] == [] and all(chunk["choices"] for chunk in chunks[:-1])
    assert all(chunk.get("usage") is None for chunk in chunks[:-1])
    return chunks, chunks[-1]["usage"]


def test_opencodes_request_streams_to_the_window_and_its_next_turn_is_cached(platform: Platform) -> None:
    session, nonce = f"ses_{uuid.uuid4().hex[:26]}", uuid.uuid4().hex
    chunks, usage = opencode_turn(
        platform, session, nonce, "List the Python files under src/ and explain them."
    )
    finishes = [choice["finish_reason"] for chunk in chunks for choice in chunk["choices"]]
    # max_tokens 32,000 on a 2,048-token window: cut to what the window leaves, then `length`.
    assert finishes[-1] == "length" and finishes.count("length") == 1
    assert usage["prompt_tokens"] + usage["completion_tokens"] == 2048
    assert usage["total_tokens"] == 2048
    # Its answer fills the window, so the next turn cannot carry it on this model; what OpenCode
    # repeats on every turn of the project (system prompt, environment, tools) is the prefix.
    _, again = opencode_turn(platform, session, nonce, "Now run the tests.")
    cached = again["prompt_tokens_details"]["cached_tokens"]
    # All but the new question and the block it starts in.
    assert again["prompt_tokens"] - 64 < cached < again["prompt_tokens"]
