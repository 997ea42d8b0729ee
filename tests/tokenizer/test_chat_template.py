"""ApplyChatTemplate's rendering equals transformers' apply_chat_template on the same model."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from cachet.common.v1 import common_pb2
from cachet.errors import InvalidArgument
from cachet.tokenizer.chat_messages import messages_to_dicts, tools_to_dicts
from cachet.tokenizer.generic_tool_prompt import tools_system_block
from cachet.tokenizer.tokenizer_model import TokenizerModel

WEATHER_SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
WEATHER_TOOL = common_pb2.Tool(
    name="get_weather",
    description="Current weather in a city",
    parameters_schema_json=json.dumps(WEATHER_SCHEMA),
)
TIME_TOOL = common_pb2.Tool(name="get_time", description="Local time")  # no parameters at all
WEATHER_DICT = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": WEATHER_SCHEMA,
    },
}
TIME_DICT = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "Local time",
        "parameters": {"type": "object", "properties": {}},
    },
}


def message(role: str, *texts: str, **fields: Any) -> common_pb2.ChatMessage:
    parts = [common_pb2.ContentPart(text=text) for text in texts]
    return common_pb2.ChatMessage(role=role, content=parts, **fields)


def call(call_id: str, name: str, arguments: str) -> common_pb2.ToolCall:
    return common_pb2.ToolCall(id=call_id, name=name, arguments_json=arguments)


def hf_call(call_id: str, name: str, arguments: dict[str, Any]) -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


# One agent conversation, as protos and as the dicts transformers documents for tool use.
AGENT_PROTOS = [
    message("system", "You are terse."),
    message("user", "Weather and time in Paris?"),
    message(
        "assistant",
        reasoning_content="Two tools at once.",
        tool_calls=[call("c1", "get_weather", '{"city": "Paris"}'), call("c2", "get_time", "")],
    ),
    message("tool", "18°C, sunny", tool_call_id="c1"),
    message("tool", "14:05", tool_call_id="c2"),
    message("assistant", "18°C and sunny; it is 14:05."),
    message("user", "And in Tokyo?"),
]
AGENT_DICTS = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Weather and time in Paris?"},
    {
        "role": "assistant",
        "content": "",
        "reasoning_content": "Two tools at once.",
        "tool_calls": [hf_call("c1", "get_weather", {"city": "Paris"}), hf_call("c2", "get_time", {})],
    },
    {"role": "tool", "tool_call_id": "c1", "content": "18°C, sunny"},
    {"role": "tool", "tool_call_id": "c2", "content": "14:05"},
    {"role": "assistant", "content": "18°C and sunny; it is 14:05."},
    {"role": "user", "content": "And in Tokyo?"},
]

# The documented generic rewrite of the same conversation, spelled out: tools merged into
# the system message, calls as <tool_call> blocks, consecutive results as one user turn.
GENERIC_AGENT_DICTS = [
    {"role": "system", "content": "You are terse.\n\n" + tools_system_block([WEATHER_DICT, TIME_DICT])},
    {"role": "user", "content": "Weather and time in Paris?"},
    {
        "role": "assistant",
        "content": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>',
        "reasoning_content": "Two tools at once.",
    },
    {
        "role": "user",
        "content": "<tool_response>\n18°C, sunny\n</tool_response>\n<tool_response>\n14:05\n</tool_response>",
    },
    {"role": "assistant", "content": "18°C and sunny; it is 14:05."},
    {"role": "user", "content": "And in Tokyo?"},
]


@pytest.fixture(scope="module")
def hf_tiny(tiny_model_dir: Path) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(str(tiny_model_dir), local_files_only=True)


@pytest.fixture(scope="module")
def hf_tools(tools_model_dir: Path) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(str(tools_model_dir), local_files_only=True)


def render(
    model: TokenizerModel,
    messages: list[common_pb2.ChatMessage],
    tools: list[common_pb2.Tool] = (),
    **flags: bool,
):
    return model.apply_chat_template(
        messages_to_dicts(messages),
        tools_to_dicts(tools),
        add_generation_prompt=flags.get("add_generation_prompt", False),
        continue_final_message=flags.get("continue_final_message", False),
    )


def assert_same_as_transformers(
    rendered,
    hf: PreTrainedTokenizerBase,
    dicts: list[dict[str, Any]],
    tools: list[dict] | None = None,
    **flags: bool,
) -> None:
    expected_prompt = hf.apply_chat_template(dicts, tools=tools, tokenize=False, **flags)
    expected_ids = hf.apply_chat_template(dicts, tools=tools, tokenize=True, return_dict=True, **flags)[
        "input_ids"
    ]
    assert rendered.prompt == expected_prompt
    assert rendered.token_ids == list(expected_ids)


def test_single_user_message(tiny_model: TokenizerModel, hf_tiny: PreTrainedTokenizerBase) -> None:
    rendered = render(tiny_model, [message("user", "Hi there 👋")], add_generation_prompt=True)
    assert_same_as_transformers(
        rendered, hf_tiny, [{"role": "user", "content": "Hi there 👋"}], add_generation_prompt=True
    )
    # The template's default system turn, its turn markers as single special tokens, and no doubled BOS.
    assert rendered.prompt.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert rendered.prompt.endswith("<|im_start|>assistant\n")
    assert rendered.token_ids[0] == 1 and rendered.token_ids.count(1) == 3


def test_multi_turn_with_developer_role_and_text_parts(
    tiny_model: TokenizerModel, hf_tiny: PreTrainedTokenizerBase
) -> None:
    protos = [
        message("developer", "Answer in French."),
        message("user", "First part.", "Second part."),
        message("assistant", "D'accord."),
        message("user", "Capital of 日本?"),
    ]
    dicts = [
        {"role": "system", "content": "Answer in French."},
        {"role": "user", "content": "First part.\nSecond part."},
        {"role": "assistant", "content": "D'accord."},
        {"role": "user", "content": "Capital of 日本?"},
    ]
    assert_same_as_transformers(
        render(tiny_model, protos, add_generation_prompt=True), hf_tiny, dicts, add_generation_prompt=True
    )
    assert_same_as_transformers(render(tiny_model, protos), hf_tiny, dicts)


def test_continue_final_message_leaves_the_turn_open(
    tiny_model: TokenizerModel, hf_tiny: PreTrainedTokenizerBase
) -> None:
    protos = [message("user", "Count to three."), message("assistant", "One, two,")]
    dicts = [{"role": "user", "content": "Count to three."}, {"role": "assistant", "content": "One, two,"}]
    rendered = render(tiny_model, protos, continue_final_message=True)
    assert_same_as_transformers(rendered, hf_tiny, dicts, continue_final_message=True)
    assert rendered.prompt.endswith("<|im_start|>assistant\nOne, two,")


def test_template_with_native_tools_gets_the_conversation_as_transformers_documents_it(
    tools_model: TokenizerModel, hf_tools: PreTrainedTokenizerBase
) -> None:
    assert tools_model.info.template_supports_tools
    rendered = render(tools_model, AGENT_PROTOS, [WEATHER_TOOL, TIME_TOOL], add_generation_prompt=True)
    assert_same_as_transformers(
        rendered, hf_tools, AGENT_DICTS, tools=[WEATHER_DICT, TIME_DICT], add_generation_prompt=True
    )
    assert '<tool_response id="c2">\n14:05\n</tool_response>' in rendered.prompt
    assert "<think>Two tools at once.</think>" in rendered.prompt
    # Without tools the same template renders its plain branch, still through transformers.
    plain = [message("system", "Be brief."), message("user", "Hi")]
    assert_same_as_transformers(
        render(tools_model, plain),
        hf_tools,
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
    )


def test_template_without_tools_gets_the_generic_rendering(
    tiny_model: TokenizerModel, hf_tiny: PreTrainedTokenizerBase
) -> None:
    rendered = render(tiny_model, AGENT_PROTOS, [WEATHER_TOOL, TIME_TOOL], add_generation_prompt=True)
    assert_same_as_transformers(rendered, hf_tiny, GENERIC_AGENT_DICTS, add_generation_prompt=True)
    assert '{"type": "function", "function": {"name": "get_weather"' in rendered.prompt
    assert '{"name": <function-name>, "arguments": <args-json-object>}' in rendered.prompt


def test_generic_rendering_adds_a_system_turn_only_when_tools_are_offered(
    tiny_model: TokenizerModel, hf_tiny: PreTrainedTokenizerBase
) -> None:
    offered = render(tiny_model, [message("user", "Weather?")], [WEATHER_TOOL], add_generation_prompt=True)
    expected = [
        {"role": "system", "content": tools_system_block([WEATHER_DICT])},
        {"role": "user", "content": "Weather?"},
    ]
    assert_same_as_transformers(offered, hf_tiny, expected, add_generation_prompt=True)
    # A replayed call with no tools offered now: the call is still shown, the template's own
    # default system turn stays.
    replay = [
        message("user", "Weather?"),
        message("assistant", "Checking.", tool_calls=[call("c1", "get_weather", '{"city": "Oslo"}')]),
        message("tool", "-3°C", tool_call_id="c1"),
    ]
    expected = [
        {"role": "user", "content": "Weather?"},
        {
            "role": "assistant",
            "content": 'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>',
        },
        {"role": "user", "content": "<tool_response>\n-3°C\n</tool_response>"},
    ]
    rendered = render(tiny_model, replay, add_generation_prompt=True)
    assert_same_as_transformers(rendered, hf_tiny, expected, add_generation_prompt=True)
    assert "You are a helpful AI assistant named SmolLM" in rendered.prompt


@pytest.mark.parametrize(
    ("messages", "tools", "field"),
    [
        ([], [], "messages"),
        ([message("wizard", "hi")], [], "messages[0].role"),
        ([message("user", "hi"), message("tool", "18")], [], "messages[1].tool_call_id"),
        ([message("user", "hi", tool_calls=[call("c", "f", "{}")])], [], "messages[0].tool_calls"),
        (
            [message("assistant", tool_calls=[call("c", "f", "{oops")])],
            [],
            "messages[0].tool_calls[0].arguments_json",
        ),
        (
            [message("assistant", tool_calls=[call("c", "f", "[1, 2]")])],
            [],
            "messages[0].tool_calls[0].arguments_json",
        ),
        (
            [message("assistant", tool_calls=[call("c", "no spaces", "{}")])],
            [],
            "messages[0].tool_calls[0].name",
        ),
        (
            [
                common_pb2.ChatMessage(
                    role="user", content=[common_pb2.ContentPart(image_url="http://x/y.png")]
                )
            ],
            [],
            "messages[0].content[0].image_url",
        ),
        (
            [message("user", "hi")],
            [common_pb2.Tool(name="f", parameters_schema_json="{")],
            "tools[0].parameters_schema_json",
        ),
        ([message("user", "hi")], [common_pb2.Tool(name="f"), common_pb2.Tool(name="f")], "tools[1].name"),
    ],
)
def test_malformed_conversations_name_the_field(
    tiny_model: TokenizerModel, messages: list, tools: list, field: str
) -> None:
    with pytest.raises(InvalidArgument) as raised:
        render(tiny_model, messages, tools)
    assert raised.value.param == field
    assert raised.value.message.startswith(f"{field}: ")


def test_generation_prompt_and_continuation_exclude_each_other(tiny_model: TokenizerModel) -> None:
    with pytest.raises(InvalidArgument) as raised:
        render(tiny_model, [message("user", "hi")], add_generation_prompt=True, continue_final_message=True)
    assert raised.value.param == "continue_final_message"


@pytest.mark.slow
def test_default_model_renders_like_transformers(default_model_dir: Path) -> None:
    model = TokenizerModel.load("smollm2-135m-instruct", default_model_dir)
    hf = AutoTokenizer.from_pretrained(str(default_model_dir), local_files_only=True)
    plain = [message("system", "Be brief."), message("user", "Capital of France?")]
    assert_same_as_transformers(
        render(model, plain, add_generation_prompt=True),
        hf,
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Capital of France?"}],
        add_generation_prompt=True,
    )
    rendered = render(model, AGENT_PROTOS, [WEATHER_TOOL, TIME_TOOL], add_generation_prompt=True)
    if model.info.template_supports_tools:
        expected, tools = AGENT_DICTS, [WEATHER_DICT, TIME_DICT]
    else:
        expected, tools = GENERIC_AGENT_DICTS, None
    assert_same_as_transformers(rendered, hf, expected, tools=tools, add_generation_prompt=True)
