"""tool_choice as a plan (what is offered, what a call may name, with which schema) and the model-family rule.

The grammars the plans become are compiled and walked in test_call_grammar.py.
"""

from __future__ import annotations

import json

import pytest

from cachet.common.v1 import common_pb2
from cachet.errors import InvalidArgument
from cachet.router.output_parser import PlainTextParser
from cachet.router.tool_parsers.hermes import HermesToolParser
from cachet.router.tool_parsers.kimi_k2 import KimiK2ToolParser
from cachet.router.tool_parsers.model_family import ModelFamily, ToolFormat, family_of
from cachet.router.tool_parsers.reasoning import PromptReasoning, ReasoningParser, prompt_reasoning
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
NO_ARGUMENTS = {"type": "object", "properties": {}, "additionalProperties": False}
HERMES = ModelFamily(
    ToolFormat.HERMES, reasoning=False, keep_special_tokens=False, stop_token_ids=frozenset()
)


def request(
    choice: common_pb2.ToolChoice | None = None, **fields: object
) -> router_pb2.ChatCompletionRequest:
    built = router_pb2.ChatCompletionRequest(model="m", tools=TOOLS, **fields)
    if choice is not None:
        built.tool_choice.CopyFrom(choice)
    return built


def schemas(plan) -> dict[str, dict]:
    return {tool.name: schema for tool, schema in plan.call_schemas}


def test_auto_is_the_default_with_tools() -> None:
    plan = plan_tools(request())
    assert plan.mode is ToolMode.AUTO and plan.constraint_for(HERMES) is None
    assert [tool.name for tool in plan.offered] == ["get_weather", "ping"]


def test_none_offers_no_tools() -> None:
    plan = plan_tools(request(common_pb2.ToolChoice(mode=common_pb2.TOOL_CHOICE_MODE_NONE)))
    assert (plan.mode, plan.offered, plan.constraint_for(HERMES)) == (ToolMode.NONE, (), None)


def test_no_tools_is_none() -> None:
    assert plan_tools(router_pb2.ChatCompletionRequest(model="m")).mode is ToolMode.NONE


def test_named_calls_that_function_with_its_parameters_schema() -> None:
    plan = plan_tools(request(common_pb2.ToolChoice(function_name="get_weather")))
    assert (plan.mode, plan.forced_name, plan.parallel) == (ToolMode.NAMED, "get_weather", False)
    assert schemas(plan) == {"get_weather": WEATHER}
    grammar = plan.constraint_for(HERMES)
    assert grammar is not None and grammar.WhichOneof("format") == "ebnf"


def test_named_function_without_parameters_takes_an_empty_object() -> None:
    # An open object would let a weak model invent keys until max_tokens.
    assert schemas(plan_tools(request(common_pb2.ToolChoice(function_name="ping")))) == {"ping": NO_ARGUMENTS}


def test_required_may_call_any_offered_tool() -> None:
    plan = plan_tools(request(common_pb2.ToolChoice(mode=common_pb2.TOOL_CHOICE_MODE_REQUIRED)))
    assert (plan.mode, plan.parallel) == (ToolMode.REQUIRED, True)
    assert schemas(plan) == {"get_weather": WEATHER, "ping": NO_ARGUMENTS}
    one = plan_tools(
        request(common_pb2.ToolChoice(mode=common_pb2.TOOL_CHOICE_MODE_REQUIRED), parallel_tool_calls=False)
    )
    assert one.parallel is False


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
    # Forced calls are read by the family's own parser (the grammar writes its format).
    parser = output_parser_for(family, forced)
    assert isinstance(parser, ReasoningParser) and isinstance(parser._inner, HermesToolParser)


# ---------------------------------------------------------------- a think block the prompt opened


@pytest.mark.parametrize(
    ("prompt", "expected"),
    [
        ("<|im_assistant|>assistant<|im_middle|><think>", PromptReasoning.OPEN),
        ("...<think>\n", PromptReasoning.OPEN),
        ("...<|im_middle|><think></think>", PromptReasoning.CLOSED),
        ("...<think>\n</think>\n\n", PromptReasoning.CLOSED),
        ("...<|im_start|>assistant\n", PromptReasoning.UNOPENED),
        # An earlier turn's block, closed with its reasoning, leaves the answer free to open one.
        ("<think>it is 4</think>4<|im_end|><|im_start|>assistant\n", PromptReasoning.UNOPENED),
    ],
)
def test_the_rendered_prompt_says_where_the_think_block_stands(
    prompt: str, expected: PromptReasoning
) -> None:
    assert prompt_reasoning(prompt) is expected


def test_a_prompt_that_opened_the_block_starts_the_parser_inside_it() -> None:
    family = family_of(info("<think>", "</think>"))
    assert family.think_close_token_id == 1
    parser = output_parser_for(family, plan_tools(request()), PromptReasoning.OPEN)
    out = parser.feed("weighing it</think>\n\nSunny.")
    assert (out.reasoning, out.content) == ("weighing it", "Sunny.")
    unopened = output_parser_for(family, plan_tools(request()))
    assert unopened.feed("weighing it</think>Sunny.").content == "weighing it</think>Sunny."


def test_forced_kimi_calls_open_their_own_empty_block_only_where_the_prompt_did_not() -> None:
    family = family_of(info("<|im_end|>", "<|tool_calls_section_begin|>", "</think>"))
    forced = plan_tools(request(common_pb2.ToolChoice(function_name="ping")))
    unopened = forced.constraint_for(family)
    assert unopened is not None and "start: <think> </think> section" in unopened.ebnf
    for prompt in (PromptReasoning.OPEN, PromptReasoning.CLOSED):
        constraint = forced.constraint_for(family, prompt)
        assert constraint is not None and "start: section" in constraint.ebnf, prompt
        assert "<think>" not in constraint.ebnf


def test_strict_auto_lets_the_answer_think_only_where_the_prompt_has_not() -> None:
    family = family_of(info("<think>", "</think>"))
    strict = [common_pb2.Tool(name="get_weather", parameters_schema_json=json.dumps(WEATHER), strict=True)]
    plan = plan_tools(router_pb2.ChatCompletionRequest(model="m", tools=strict))
    unopened = plan.constraint_for(family)
    opened = plan.constraint_for(family, PromptReasoning.OPEN)
    assert unopened is not None and "think?" in unopened.ebnf
    assert opened is not None and "<think>" not in opened.ebnf
