"""Grammars in the family's call format: strict tools under ``auto`` (text stays free, every call
the grammar lets out validates) and Kimi K2's forced calls (only valid calls, read by its parser).

The grammar the router builds is compiled by the engine's own ``GrammarCompiler``
(llguidance, against the tiny models' real tokenizers) and walked at random: each
step picks uniformly among the tokens the grammar allows, a harsher adversary than
any model at temperature 1. A walk first writes some text and opens a call the way
the family does; from there the grammar alone decides. The family's parser reads
the output and every call must validate against its tool's schema (jsonschema).
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Callable
from pathlib import Path

import jsonschema
import llguidance
import llguidance.numpy
import numpy as np
import pytest
from test_tool_parsers import Answer
from tokenizers import Tokenizer

from cachet.common.v1 import common_pb2
from cachet.engine.structured_output import GrammarCompiler, grammar_spec_from_proto
from cachet.models.tiny import write_tiny_model
from cachet.router.output_parser import OutputParser
from cachet.router.tool_parsers import hermes, kimi_k2
from cachet.router.tool_parsers.hermes import HermesToolParser
from cachet.router.tool_parsers.kimi_k2 import KimiK2ToolParser
from cachet.router.tool_parsers.model_family import ModelFamily, ToolFormat
from cachet.router.tool_parsers.selection import output_parser_for
from cachet.router.tool_parsers.tool_choice import ToolMode, plan_tools
from cachet.router.v1 import router_pb2

# Real-world shapes, every string and number bounded so a random walk ends.
BOOKING = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 10},
        "nights": {"type": "integer", "minimum": 1, "maximum": 30},
        "room": {"enum": ["single", "double", "suite"]},
        "guests": {
            "type": "array",
            "items": {"$ref": "#/$defs/guest"},
            "minItems": 1,
            "maxItems": 2,
        },
        "breakfast": {"type": "boolean"},
    },
    "required": ["city", "nights", "room", "guests"],
    "additionalProperties": False,
    "$defs": {
        "guest": {
            "type": "object",
            "properties": {
                "name": {"type": "string", "minLength": 1, "maxLength": 8},
                "age": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 120}, {"type": "null"}]},
            },
            "required": ["name", "age"],
            "additionalProperties": False,
        }
    },
}
PING = {"type": "object", "properties": {}, "additionalProperties": False}
SCHEMAS = {"book_hotel": BOOKING, "ping": PING}
TOOLS = [
    common_pb2.Tool(name="book_hotel", parameters_schema_json=json.dumps(BOOKING), strict=True),
    common_pb2.Tool(name="ping", strict=True),
]
HERMES = ModelFamily(
    ToolFormat.HERMES, reasoning=False, keep_special_tokens=False, stop_token_ids=frozenset()
)
KIMI_K2 = ModelFamily(
    ToolFormat.KIMI_K2, reasoning=True, keep_special_tokens=True, stop_token_ids=frozenset()
)
WALKS = 40
MAX_STEPS = 400


def auto_request(tools: list[common_pb2.Tool] = TOOLS, **fields: object) -> router_pb2.ChatCompletionRequest:
    return router_pb2.ChatCompletionRequest(model="m", tools=tools, **fields)


# ---------------------------------------------------------------- the plan


def test_auto_without_strict_tools_is_free_text() -> None:
    plain = [common_pb2.Tool(name="ping")]
    assert plan_tools(auto_request(plain)).constraint_for(HERMES) is None


def test_auto_with_a_strict_tool_is_a_grammar_in_the_family_format() -> None:
    plan = plan_tools(auto_request())
    assert plan.mode is ToolMode.AUTO
    hermes_grammar = plan.constraint_for(HERMES)
    kimi_grammar = plan.constraint_for(KIMI_K2)
    assert hermes_grammar is not None and kimi_grammar is not None
    assert hermes.OPEN in hermes_grammar.ebnf and kimi_k2.SECTION_BEGIN not in hermes_grammar.ebnf
    assert kimi_k2.SECTION_BEGIN in kimi_grammar.ebnf and "<think>" in kimi_grammar.ebnf


def test_a_response_format_wins_over_strict_auto() -> None:
    json_object = common_pb2.ResponseFormat(json_object=common_pb2.JsonObjectFormat())
    assert plan_tools(auto_request(response_format=json_object)).constraint_for(HERMES) is None


# ---------------------------------------------------------------- what the grammar lets out


class Family:
    """A tiny model's tokenizer with the engine's compiler, and how the family opens a call."""

    def __init__(
        self, model_dir: Path, family: ModelFamily, opening: str, parser: Callable[[], OutputParser]
    ):
        self.tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        self.eos = self.tokenizer.token_to_id("<|im_end|>")
        self.vocab_size = self.tokenizer.get_vocab_size()
        self.compiler = GrammarCompiler(self.tokenizer, self.vocab_size, [self.eos], max_workers=1)
        self.family, self.opening, self.new_parser = family, opening, parser

    def matcher(
        self, plan_parallel: bool = True, request: router_pb2.ChatCompletionRequest | None = None
    ) -> llguidance.LLMatcher:
        if request is None:
            request = auto_request() if plan_parallel else auto_request(parallel_tool_calls=False)
        constraint = plan_tools(request).constraint_for(self.family)
        assert constraint is not None
        return self.compiler.new_matcher(grammar_spec_from_proto(constraint)).result(timeout=60)

    def allowed(self, matcher: llguidance.LLMatcher) -> np.ndarray:
        bitmask = llguidance.numpy.allocate_token_bitmask(1, self.vocab_size)
        llguidance.numpy.fill_next_token_bitmask(matcher, bitmask, 0)
        bits = (bitmask[0][:, None] >> np.arange(32, dtype=np.int32)) & 1
        return np.flatnonzero(bits.reshape(-1)[: self.vocab_size])


@pytest.fixture(scope="module", params=["hermes", "kimi-k2"])
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Family:
    root = tmp_path_factory.mktemp("strict-auto")
    if request.param == "hermes":
        model = write_tiny_model(root / "tiny-llama")
        return Family(model, HERMES, f"Let me book it.\n{hermes.OPEN}\n", lambda: HermesToolParser(SCHEMAS))
    model = write_tiny_model(root / "tiny-kimi-k2", family="kimi-k2")
    opening = f"<think>booking</think>On it.{kimi_k2.SECTION_BEGIN}{kimi_k2.CALL_BEGIN}"
    return Family(model, KIMI_K2, opening, lambda: KimiK2ToolParser(SCHEMAS))


def walk(
    family: Family, seed: int, request: router_pb2.ChatCompletionRequest | None = None, opening: str = ""
) -> str:
    """The opening, then random allowed tokens until end-of-sequence or MAX_STEPS."""
    draw = random.Random(seed)
    matcher = family.matcher(request=request)
    opening = family.tokenizer.encode(opening if request else family.opening, add_special_tokens=False).ids
    assert not opening or matcher.consume_tokens(opening), matcher.get_error()
    tokens = list(opening)
    for _ in range(MAX_STEPS):
        allowed = family.allowed(matcher)
        assert len(allowed), "the grammar always leaves a way on"
        token = int(draw.choice(allowed))
        if token == family.eos:
            break
        assert matcher.consume_token(token), matcher.get_error()
        tokens.append(token)
    return family.tokenizer.decode(tokens, skip_special_tokens=False)


def test_every_call_the_grammar_lets_out_validates(family: Family) -> None:
    names = []
    for seed in range(WALKS):
        text = walk(family, seed)
        parser = family.new_parser()
        answer = [*parser.feed(text).tool_calls, *parser.finish().tool_calls]
        headers = [delta for delta in answer if delta.name]
        assert headers, f"the opened call was not read as one: {text!r}"
        for header in headers:
            arguments = "".join(d.arguments_delta for d in answer if d.index == header.index)
            jsonschema.validate(json.loads(arguments), SCHEMAS[header.name])
            names.append(header.name)
    assert set(names) == set(SCHEMAS), "the walks reached every tool"


def test_text_cannot_hold_a_call_the_grammar_did_not_check(family: Family) -> None:
    """Outside a call everything is allowed, except writing the call format with a bad call."""
    matcher = family.matcher()
    assert matcher.consume_tokens(family.tokenizer.encode(family.opening, add_special_tokens=False).ids)
    bad = '{"name": "delete_all", "arguments": {}}' if family.family is HERMES else "functions.delete_all:0"
    ids = family.tokenizer.encode(bad, add_special_tokens=False).ids
    assert not all(matcher.consume_token(token) for token in ids)


def test_one_call_when_parallel_calls_are_off(family: Family) -> None:
    matcher = family.matcher(plan_parallel=False)
    if family.family is HERMES:
        call = '{"name": "ping", "arguments": {}}\n</tool_call>'
        text = f"{family.opening}{call} and again <tool_call>\n{call}"
    else:
        end = f"{kimi_k2.ARGUMENT_BEGIN}{{}}{kimi_k2.CALL_END}"
        text = f"{family.opening}functions.ping:0{end}{kimi_k2.CALL_BEGIN}functions.ping:1{end}"
    ids = family.tokenizer.encode(text, add_special_tokens=False).ids
    assert not all(matcher.consume_token(token) for token in ids)


# ---------------------------------------------------------------- forced calls


@pytest.mark.parametrize(
    ("choice", "parallel"),
    [
        (common_pb2.ToolChoice(function_name="book_hotel"), True),
        (common_pb2.ToolChoice(mode=common_pb2.TOOL_CHOICE_MODE_REQUIRED), True),
        (common_pb2.ToolChoice(mode=common_pb2.TOOL_CHOICE_MODE_REQUIRED), False),
    ],
    ids=["named", "required", "required-one"],
)
def test_forced_calls_are_the_familys_own_format(
    family: Family, choice: common_pb2.ToolChoice, parallel: bool
) -> None:
    """Only calls, every one valid, written as the template renders them and read by the family's parser."""
    request = auto_request(tool_choice=choice, parallel_tool_calls=parallel)
    plan = plan_tools(request)
    opening = "<think></think>" + kimi_k2.SECTION_BEGIN if family.family is KIMI_K2 else hermes.OPEN + "\n"
    seen, counts = set(), set()
    for seed in range(WALKS // 2):
        text = walk(family, seed, request)
        assert text.startswith(opening), text
        parser = output_parser_for(family.family, plan)
        answer = Answer()
        answer.add(parser.feed(text))
        answer.add(parser.finish())
        assert answer.content == "" and answer.reasoning == "", text
        counts.add(len(answer.calls))
        for call_id, name, arguments in answer.calls.values():
            if family.family is KIMI_K2:
                assert re.fullmatch(rf"functions\.{name}:\d+", call_id)  # K2's own id, kept
            else:
                assert call_id.startswith("call_")
            jsonschema.validate(json.loads(arguments), SCHEMAS[name])
            seen.add(name)
    assert 0 not in counts
    if not parallel or plan.mode is ToolMode.NAMED:
        assert counts == {1}
    assert seen == ({"book_hotel"} if plan.mode is ToolMode.NAMED else set(SCHEMAS))


def test_forced_call_grammar_refuses_what_the_schema_does(family: Family) -> None:
    named = auto_request(tool_choice=common_pb2.ToolChoice(function_name="book_hotel"))
    if family.family is KIMI_K2:
        head = f"<think></think>{kimi_k2.SECTION_BEGIN}{kimi_k2.CALL_BEGIN}functions.book_hotel:0{kimi_k2.ARGUMENT_BEGIN}"
    else:
        head = f'{hermes.OPEN}\n{{"name": "book_hotel", "arguments": '
    for bad in (
        '{"city": 3',
        '{"city": "Oslo", "nights": 31',
        '{"city": "Oslo", "nights": 2, "room": "tent"',
    ):
        matcher = family.matcher(request=named)
        ids = family.tokenizer.encode(head + bad, add_special_tokens=False).ids
        assert not all(matcher.consume_token(token) for token in ids), bad
    # Another function than the named one cannot be written at all.
    matcher = family.matcher(request=named)
    other = head.replace("book_hotel", "ping")
    assert not all(
        matcher.consume_token(t) for t in family.tokenizer.encode(other, add_special_tokens=False).ids
    )


def test_text_without_calls_is_free(family: Family) -> None:
    """Under auto the model may just answer: any text (tag look-alikes included) then end-of-turn."""
    if family.family is HERMES:
        text = "Sure: a < b, <tool calls> and </tool_call> are text.\n\nDone."
    else:
        text = "<think>a <|tool plan</think>Sure: no call needed.\n"
    matcher = family.matcher()
    assert matcher.consume_tokens(family.tokenizer.encode(text, add_special_tokens=False).ids)
    assert matcher.consume_token(family.eos) and matcher.is_stopped()
