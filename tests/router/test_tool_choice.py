"""tool_choice as a plan, the grammar constraints it builds, and the model-family rule.

The constraints are checked by what they accept: sample outputs are validated
against each schema (the engine compiles the same schema into its grammar).
"""

from __future__ import annotations

import json

import jsonschema
import pytest

from cachet.common.v1 import common_pb2
from cachet.errors import InvalidArgument
from cachet.router.output_parser import PlainTextParser
from cachet.router.tool_parsers.forced import NamedToolCallParser, RequiredToolCallsParser
from cachet.router.tool_parsers.hermes import HermesToolParser
from cachet.router.tool_parsers.kimi_k2 import KimiK2ToolParser
from cachet.router.tool_parsers.model_family import ToolFormat, family_of
from cachet.router.tool_parsers.reasoning import ReasoningParser
from cachet.router.tool_parsers.selection import output_parser_for, output_setup_for
from cachet.router.tool_parsers.tool_choice import ToolMode, plan_tools
from cachet.router.v1 import router_pb2
from cachet.tokenizer.v1 import tokenizer_pb2

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
    "required": ["city"],
    "additionalProperties": False,
}
TOOLS = [
    common_pb2.Tool(name="get_weather", parameters_schema_json=json.dumps(WEATHER)),
    common_pb2.Tool(name="ping"),  # no parameters: a function that takes none
]


def request(
    choice: common_pb2.ToolChoice | None = None, **fields: object
) -> router_pb2.ChatCompletionRequest:
    built = router_pb2.ChatCompletionRequest(model="m", tools=TOOLS, **fields)
    if choice is not None:
        built.tool_choice.CopyFrom(choice)
    return built


def schema_of(fmt: common_pb2.ResponseFormat) -> dict:
    assert fmt.WhichOneof("format") == "json_schema"
    return json.loads(fmt.json_schema.schema_json)


def accepts(schema: dict, text: str) -> bool:
    try:
        jsonschema.validate(json.loads(text), schema)
    except (json.JSONDecodeError, jsonschema.ValidationError):
        return False
    return True


def test_auto_is_the_default_with_tools() -> None:
    plan = plan_tools(request())
    assert plan.mode is ToolMode.AUTO and plan.constraint is None
    assert [tool.name for tool in plan.offered] == ["get_weather", "ping"]


def test_none_offers_no_tools() -> None:
    plan = plan_tools(request(common_pb2.ToolChoice(mode=common_pb2.TOOL_CHOICE_MODE_NONE)))
    assert (plan.mode, plan.offered, plan.constraint) == (ToolMode.NONE, (), None)


def test_no_tools_is_none() -> None:
    assert plan_tools(router_pb2.ChatCompletionRequest(model="m")).mode is ToolMode.NONE


def test_named_constrains_to_the_parameters_schema() -> None:
    plan = plan_tools(request(common_pb2.ToolChoice(function_name="get_weather")))
    assert (plan.mode, plan.forced_name) == (ToolMode.NAMED, "get_weather")
    assert plan.constraint is not None
    schema = schema_of(plan.constraint)
    assert schema == WEATHER
    assert accepts(schema, '{"city": "Paris", "days": 3}')
    assert not accepts(schema, '{"days": 3}')
    assert not accepts(schema, '{"city": 3}')


def test_named_function_without_parameters_takes_an_empty_object() -> None:
    plan = plan_tools(request(common_pb2.ToolChoice(function_name="ping")))
    assert plan.constraint is not None
    schema = schema_of(plan.constraint)
    assert accepts(schema, "{}")
    assert not accepts(schema, '{"invented": 1}')
    assert plan.constraint.json_schema.strict is False  # ping is not a strict tool


def test_strict_tools_ask_the_engine_for_strict_schemas() -> None:
    strict = [common_pb2.Tool(name="f", strict=True), common_pb2.Tool(name="g", strict=True)]
    named = plan_tools(
        router_pb2.ChatCompletionRequest(
            model="m", tools=strict, tool_choice=common_pb2.ToolChoice(function_name="g")
        )
    )
    required = plan_tools(
        router_pb2.ChatCompletionRequest(
            model="m",
            tools=strict,
            tool_choice=common_pb2.ToolChoice(mode=common_pb2.TOOL_CHOICE_MODE_REQUIRED),
        )
    )
    assert named.constraint is not None and named.constraint.json_schema.strict
    assert required.constraint is not None and required.constraint.json_schema.strict


def test_required_is_an_array_of_calls_of_offered_tools() -> None:
    plan = plan_tools(request(common_pb2.ToolChoice(mode=common_pb2.TOOL_CHOICE_MODE_REQUIRED)))
    assert plan.mode is ToolMode.REQUIRED and plan.constraint is not None
    schema = schema_of(plan.constraint)
    assert accepts(
        schema, '[{"name": "get_weather", "arguments": {"city": "Oslo"}}, {"name": "ping", "arguments": {}}]'
    )
    assert not accepts(schema, "[]")
    assert not accepts(schema, '[{"name": "get_weather", "arguments": {"days": 1}}]')
    assert not accepts(schema, '[{"name": "other", "arguments": {}}]')


def test_required_without_parallel_calls_allows_one() -> None:
    plan = plan_tools(
        request(common_pb2.ToolChoice(mode=common_pb2.TOOL_CHOICE_MODE_REQUIRED), parallel_tool_calls=False)
    )
    assert plan.constraint is not None
    schema = schema_of(plan.constraint)
    assert accepts(schema, '[{"name": "ping", "arguments": {}}]')
    assert not accepts(schema, '[{"name": "ping", "arguments": {}}, {"name": "ping", "arguments": {}}]')


def test_forced_output_reads_back_through_the_parsers() -> None:
    required = RequiredToolCallsParser({"get_weather", "ping"})
    header, arguments = required.feed('[{"name": "get_weather", "arguments": {"city": "Oslo"}}]').tool_calls
    assert (header.name, header.arguments_delta) == ("get_weather", "")
    assert json.loads(arguments.arguments_delta) == {"city": "Oslo"}
    named = NamedToolCallParser("ping")
    assert [(d.name, d.arguments_delta) for d in named.feed("{}").tool_calls] == [("ping", ""), ("", "{}")]


@pytest.mark.parametrize(
    "bad",
    [
        router_pb2.ChatCompletionRequest(
            model="m", tool_choice=common_pb2.ToolChoice(mode=common_pb2.TOOL_CHOICE_MODE_REQUIRED)
        ),
        router_pb2.ChatCompletionRequest(model="m", tool_choice=common_pb2.ToolChoice(function_name="x")),
        request(common_pb2.ToolChoice(function_name="not_offered")),
        request(
            common_pb2.ToolChoice(mode=common_pb2.TOOL_CHOICE_MODE_REQUIRED),
            response_format=common_pb2.ResponseFormat(json_object=common_pb2.JsonObjectFormat()),
        ),
    ],
)
def test_choices_that_cannot_be_honoured(bad: router_pb2.ChatCompletionRequest) -> None:
    with pytest.raises(InvalidArgument):
        plan_tools(bad)


@pytest.mark.parametrize(
    "choice",
    [
        None,
        common_pb2.ToolChoice(function_name="f"),
        common_pb2.ToolChoice(mode=common_pb2.TOOL_CHOICE_MODE_REQUIRED),
    ],
    ids=["auto", "named", "required"],
)
def test_strict_schema_that_cannot_be_enforced_is_refused(choice: common_pb2.ToolChoice | None) -> None:
    unenforceable = {"type": "object", "properties": {"tags": {"type": "array", "uniqueItems": True}}}
    tools = [
        common_pb2.Tool(name="g", strict=True),
        common_pb2.Tool(name="f", parameters_schema_json=json.dumps(unenforceable), strict=True),
    ]
    strict = router_pb2.ChatCompletionRequest(model="m", tools=tools)
    if choice is not None:
        strict.tool_choice.CopyFrom(choice)
    with pytest.raises(InvalidArgument) as raised:
        plan_tools(strict)
    assert raised.value.param == "tools[1].parameters"
    assert "uniqueItems" in str(raised.value)
    # The same schema on a tool that is not strict is the client's choice.
    strict.tools[1].strict = False
    plan_tools(strict)


def test_broken_parameters_schema_is_the_clients_error() -> None:
    broken = router_pb2.ChatCompletionRequest(
        model="m",
        tools=[common_pb2.Tool(name="f", parameters_schema_json="{nope")],
        tool_choice=common_pb2.ToolChoice(function_name="f"),
    )
    with pytest.raises(InvalidArgument) as raised:
        plan_tools(broken)
    assert raised.value.param == "tools[0].parameters"


# ---------------------------------------------------------------- model family


def info(*specials: str, stops: tuple[int, ...] = (2,)) -> tokenizer_pb2.ModelInfo:
    return tokenizer_pb2.ModelInfo(
        model="m",
        special_tokens=[tokenizer_pb2.SpecialToken(text=text, token_id=i) for i, text in enumerate(specials)],
        stop_token_ids=stops,
    )


def test_plain_vocabulary_is_hermes_without_reasoning() -> None:
    family = family_of(info("<|im_start|>", "<|im_end|>"))
    assert (family.tool_format, family.reasoning, family.keep_special_tokens) == (
        ToolFormat.HERMES,
        False,
        False,
    )
    auto = plan_tools(request())
    assert isinstance(output_parser_for(family, auto), HermesToolParser)
    none = plan_tools(request(common_pb2.ToolChoice(mode=common_pb2.TOOL_CHOICE_MODE_NONE)))
    assert isinstance(output_parser_for(family, none), PlainTextParser)


def test_kimi_vocabulary_is_kimi_with_reasoning_and_special_tokens() -> None:
    family = family_of(info("<|im_end|>", "<|tool_calls_section_begin|>", stops=(7,)))
    assert (family.tool_format, family.reasoning, family.keep_special_tokens) == (
        ToolFormat.KIMI_K2,
        True,
        True,
    )
    parser = output_parser_for(family, plan_tools(request()))
    assert isinstance(parser, ReasoningParser)
    assert isinstance(parser._inner, KimiK2ToolParser)
    assert output_setup_for(family, plan_tools(request())).stop_token_ids == frozenset({7})


def test_think_token_turns_on_reasoning_for_hermes_models() -> None:
    family = family_of(info("<think>", "</think>"))
    assert (family.tool_format, family.reasoning) == (ToolFormat.HERMES, True)
    forced = plan_tools(request(common_pb2.ToolChoice(function_name="ping")))
    # The grammar leaves no room for a think block.
    assert isinstance(output_parser_for(family, forced), NamedToolCallParser)
