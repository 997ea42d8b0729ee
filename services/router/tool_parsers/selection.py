"""The output parser of one request: the family's tool parser as the tool plan asks, inside the reasoning parser.

=============  ==================================  =========================
tool plan      Hermes family                       Kimi K2 family
=============  ==================================  =========================
none           plain text                          plain text
auto           ``HermesToolParser``                ``KimiK2ToolParser``
named          ``HermesToolParser`` (that name)    ``KimiK2ToolParser`` (that name)
required       ``HermesToolParser``                ``KimiK2ToolParser``
=============  ==================================  =========================

Forced calls are written in the family's own format (``call_grammar``), so one
parser per family reads every plan. Reasoning models get theirs wrapped in
``ReasoningParser`` (a forced Kimi K2 turn opens with an empty think block).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from cachet.router.output_parser import OutputParser, PlainTextParser
from cachet.router.tool_parsers.hermes import HermesToolParser
from cachet.router.tool_parsers.kimi_k2 import KimiK2ToolParser
from cachet.router.tool_parsers.model_family import ModelFamily, ToolFormat
from cachet.router.tool_parsers.reasoning import PromptReasoning, ReasoningParser
from cachet.router.tool_parsers.tool_choice import ToolMode, ToolPlan


def output_parser_for(
    family: ModelFamily, plan: ToolPlan, prompt: PromptReasoning = PromptReasoning.UNOPENED
) -> OutputParser:
    names = {plan.forced_name} if plan.mode is ToolMode.NAMED else plan.tool_names
    parser: OutputParser
    if plan.mode is ToolMode.NONE:
        parser = PlainTextParser()
    elif family.tool_format is ToolFormat.KIMI_K2:
        parser = KimiK2ToolParser(names)
    else:
        parser = HermesToolParser(names)
    if not family.reasoning:
        return parser
    return ReasoningParser(parser, starts_in_reasoning=prompt is PromptReasoning.OPEN)


@dataclass(frozen=True)
class OutputSetup:
    """How one generation's tokens become its answer: decoding settings and the parser to use."""

    new_parser: Callable[[], OutputParser] = PlainTextParser
    # Decode special tokens too (the parser's markers are special tokens); then the
    # stop token that ended the turn is not decoded (it is no answer text).
    keep_special_tokens: bool = False
    stop_token_ids: frozenset[int] = frozenset()


PLAIN_TEXT = OutputSetup()


def output_setup_for(
    family: ModelFamily, plan: ToolPlan, prompt: PromptReasoning = PromptReasoning.UNOPENED
) -> OutputSetup:
    return OutputSetup(
        new_parser=lambda: output_parser_for(family, plan, prompt),
        keep_special_tokens=family.keep_special_tokens,
        stop_token_ids=family.stop_token_ids,
    )
