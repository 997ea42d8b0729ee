"""Image input through real processes with the official openai client: bridge -> router ->
tokenizer (decode, resize, placeholders) -> engine (vision tower, prefix cache) on the tiny Kimi
K2.5 checkpoint.

The image is a data URL of a PNG this test draws. Usage counts its placeholder tokens as prompt
tokens; the same picture in the next request is read from the prefix cache, a picture that
differs in one pixel is not (past the block before it); tool calls and structured outputs keep
working with an image in the conversation; a broken image is a 400 naming the part.

K2.5's generation prompt opens a think block unless thinking is off: then the output starts as
reasoning, and a constraint holds only the answer after ``</think>``.
"""

from __future__ import annotations

import base64
import io
import json
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import openai
import pytest
from PIL import Image
from service_processes import ENGINE_SERVER_BUILT, CachetStack, ServiceProcess

from cachet.models.tiny import TINY_MODEL_IDS, write_tiny_model

MODEL = TINY_MODEL_IDS["kimi-k2.5"]
TIMEOUT = 120.0
GREEDY = {"temperature": 0.0, "max_tokens": 4}
# The template's switch: the generation prompt writes an empty think block, the answer follows.
THINKING_OFF = {"extra_body": {"chat_template_kwargs": {"thinking": False}}}


@dataclass
class VisionPlatform:
    stack: CachetStack
    bridge: ServiceProcess

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(
            base_url=f"http://{self.bridge.address}/v1", api_key="dev", max_retries=0, timeout=TIMEOUT
        )


@pytest.fixture(scope="module")
def vision(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VisionPlatform]:
    if not ENGINE_SERVER_BUILT:
        pytest.skip("the engine server (cachet.engine.main) is not built yet")
    root = tmp_path_factory.mktemp("vision-e2e")
    stack = CachetStack(root, write_tiny_model(root / MODEL, family="kimi-k2.5")).start(engines=1)
    try:
        yield VisionPlatform(stack, stack.start_bridge())
    finally:
        stack.stop()
        print(stack.logs())


def png(width: int = 90, height: int = 70, changed_pixel: bool = False) -> str:
    image = Image.new("RGB", (width, height))
    image.putdata(
        [((x * 7) % 256, (y * 11) % 256, (x * y) % 256) for y in range(height) for x in range(width)]
    )
    if changed_pixel:
        image.putpixel((40, 30), (1, 2, 3))
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def messages(system: str, image_url: str) -> list[dict]:
    return [
        {"role": "system", "content": system},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "What is in this picture?"},
                {"type": "image_url", "image_url": {"url": image_url}},
                {"type": "text", "text": "Answer in one word."},
            ],
        },
    ]


def test_the_same_picture_is_read_from_the_cache_and_a_changed_pixel_is_not(vision: VisionPlatform) -> None:
    client = vision.client()
    system = f"[{uuid.uuid4().hex}] You describe pictures."
    text_only = client.chat.completions.create(
        model=MODEL, messages=[messages(system, png())[0], {"role": "user", "content": "Hi"}], **GREEDY
    )
    first = client.chat.completions.create(model=MODEL, messages=messages(system, png()), **GREEDY)
    # A 90x70 picture resizes to a 6x8 grid of 14-pixel patches (padded to 2x2 merges): 12 tokens.
    assert first.usage.prompt_tokens >= text_only.usage.prompt_tokens + 12
    again = client.chat.completions.create(model=MODEL, messages=messages(system, png()), **GREEDY)
    assert again.choices[0].message.content == first.choices[0].message.content
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert cached >= first.usage.prompt_tokens - 16  # every full block, the picture's included
    changed = client.chat.completions.create(
        model=MODEL, messages=messages(system, png(changed_pixel=True)), **GREEDY
    )
    assert changed.usage.prompt_tokens == first.usage.prompt_tokens
    assert changed.usage.prompt_tokens_details.cached_tokens < cached - 12


def test_tool_calls_and_structured_outputs_work_with_a_picture_in_the_conversation(
    vision: VisionPlatform,
) -> None:
    client = vision.client()
    conversation = messages(f"[{uuid.uuid4().hex}] Use the tools.", png())
    tool = {
        "type": "function",
        "function": {
            "name": "describe",
            "parameters": {
                "type": "object",
                "properties": {"colour": {"type": "string", "maxLength": 8}},
                "required": ["colour"],
                "additionalProperties": False,
            },
        },
    }
    called = client.chat.completions.create(
        model=MODEL,
        messages=conversation,
        tools=[tool],
        tool_choice={"type": "function", "function": {"name": "describe"}},
        temperature=1.0,
        seed=3,
        max_tokens=60,
        **THINKING_OFF,
    )
    call = called.choices[0].message.tool_calls[0]
    assert call.function.name == "describe"
    assert set(json.loads(call.function.arguments)) == {"colour"}

    schema = {
        "type": "object",
        "properties": {"answer": {"type": "string", "maxLength": 10}},
        "required": ["answer"],
        "additionalProperties": False,
    }
    structured = client.chat.completions.create(
        model=MODEL,
        messages=conversation,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "a", "schema": schema, "strict": True},
        },
        temperature=1.0,
        seed=4,
        max_tokens=60,
        **THINKING_OFF,
    )
    assert set(json.loads(structured.choices[0].message.content)) == {"answer"}


def test_with_thinking_on_the_output_starts_as_reasoning_and_the_schema_waits_for_the_answer(
    vision: VisionPlatform,
) -> None:
    """The tiny model's random weights never close the block in a few tokens: all of it is
    reasoning, free text the schema does not hold (the engine's tests pin what follows ``</think>``)."""
    client = vision.client()
    conversation = messages(f"[{uuid.uuid4().hex}] Think first.", png())
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}

    def ask(**switch: object):
        return client.chat.completions.create(
            model=MODEL,
            messages=conversation,
            response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema}},
            temperature=0.0,
            max_tokens=12,
            **switch,
        )

    thought = ask()
    message = thought.choices[0].message
    reasoning = message.model_extra["reasoning_content"]
    assert reasoning and not message.content, message
    assert not reasoning.lstrip().startswith("{"), "the schema held the reasoning"
    assert thought.choices[0].finish_reason == "length"
    off = ask(**THINKING_OFF)
    assert off.choices[0].message.content.startswith("{"), off.choices[0].message


@pytest.mark.parametrize(
    "url",
    [
        "data:image/png;base64,not-base64!!",
        "data:image/png;base64," + base64.b64encode(b"\x89PNG\r\n\x1a\n broken").decode(),
        "http://images.example.invalid/cat.png",
    ],
)
def test_a_broken_picture_is_a_400_naming_the_part(vision: VisionPlatform, url: str) -> None:
    with pytest.raises(openai.BadRequestError) as raised:
        vision.client().chat.completions.create(model=MODEL, messages=messages("s", url), **GREEDY)
    error = raised.value.body
    assert error["param"] == "messages[1].content[1].image_url", error
    assert error["type"] == "invalid_request_error"


def test_workers_ai_run_takes_the_picture_as_bytes_or_base64(vision: VisionPlatform) -> None:
    picture = base64.b64decode(png().split(",", 1)[1])
    system = f"[{uuid.uuid4().hex}] You describe pictures."
    run = f"http://{vision.bridge.address}/ai/run/{MODEL}"
    headers = {"Authorization": "Bearer dev"}
    base = {"messages": [{"role": "system", "content": system}, {"role": "user", "content": "Describe it."}]}
    base |= {"max_tokens": 2, "temperature": 0}
    plain = httpx.post(run, json=base, headers=headers, timeout=TIMEOUT).json()["result"]
    as_bytes = httpx.post(run, json=base | {"image": list(picture)}, headers=headers, timeout=TIMEOUT)
    assert as_bytes.status_code == 200, as_bytes.text
    with_image = as_bytes.json()["result"]
    assert with_image["usage"]["prompt_tokens"] >= plain["usage"]["prompt_tokens"] + 12
    as_base64 = httpx.post(
        run, json=base | {"image": base64.b64encode(picture).decode()}, headers=headers, timeout=TIMEOUT
    ).json()["result"]
    assert as_base64["usage"]["prompt_tokens"] == with_image["usage"]["prompt_tokens"]
    assert as_base64["response"] == with_image["response"]

    raw = httpx.post(
        run, json={"prompt": "x", "raw": True, "image": [1, 2]}, headers=headers, timeout=TIMEOUT
    )
    assert raw.status_code == 400 and "image needs a templated prompt" in raw.text, raw.text
