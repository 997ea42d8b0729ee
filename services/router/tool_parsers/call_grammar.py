"""Grammars in a model family's own call format (llguidance Lark, sent as ``ResponseFormat.ebnf``).

``tool_choice: auto`` with ``strict`` tools: the model may answer in text or call
tools, and a JSON schema cannot say "text, or a tagged call". A Lark grammar can:
text is free until the model opens a call in its family's format, and from there
the call must be one of the offered tools, its arguments valid for that tool's
``parameters`` when the tool is ``strict`` (any JSON object when it is not), and
then closed.

- Hermes: text up to the first ``<tool_call>`` is one *lazy* lexeme (it ends at
  that tag); the closing text may not contain the tag at all (regex ``&`` / ``~``),
  so a tag the model writes always starts a checked call.
- Kimi K2: its markers are special tokens, which text lexemes never match: the
  section can only be written through the grammar's own rule.
- Reasoning families may open with one ``<think>...</think>`` block (llguidance
  sees those added tokens as special, so the grammar names them), unless the
  generation prompt already wrote the block's opening (or the whole block): then
  the grammar is the answer alone, and where the prompt left the block open the
  engine applies it from the token after ``</think>`` (``constrain_after_token_id``).

Forced calls (``tool_choice`` named or required, ``forced_grammar``) are written
in the family's format too, exactly as its chat template renders a turn of calls
afterwards: Kimi K2 an empty think block then the call section, Hermes
``<tool_call>\n{...}\n</tool_call>`` blocks joined by newlines. So the next
turn's prompt starts with this turn's tokens (cached), and the family's own
parser reads the calls.

The Hermes call object is written name first (``{"name": ..., "arguments": ...}``),
the order the parsers stream; ``parallel_tool_calls: false`` allows one call.
Arguments are spaced exactly as chat templates render them back (``tojson`` /
``json.dumps``: ``", "`` and ``": "``, no other whitespace), so a turn's call and
its rendering in the next prompt are the same tokens; free whitespace would also
let a weak model spend its budget on newlines.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from cachet.common.v1 import common_pb2
from cachet.router.tool_parsers import hermes, kimi_k2, reasoning
from cachet.router.tool_parsers.model_family import ModelFamily, ToolFormat

# An object with any keys: the arguments of a tool that is not strict.
_ANY_OBJECT: dict[str, Any] = {"type": "object"}
_AS_RENDERED = {"x-guidance": {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}}


ToolSchemas = Sequence[tuple[common_pb2.Tool, dict[str, Any]]]


def strict_auto_grammar(
    family: ModelFamily,
    tools: ToolSchemas,
    *,
    parallel: bool,
    prompt: reasoning.PromptReasoning = reasoning.PromptReasoning.UNOPENED,
) -> common_pb2.ResponseFormat:
    """``tools``: each offered tool with its parameters schema (as ``tool_choice`` reads it)."""
    rules = _kimi_k2_rules if family.tool_format is ToolFormat.KIMI_K2 else _hermes_rules
    arguments = [(tool, schema if tool.strict else _ANY_OBJECT) for tool, schema in tools]
    answer, body = rules(arguments, parallel)
    # Special tokens are named as they are spelled (<|...|>, <think>): Lark's token syntax.
    start = [f"start: {answer}"]
    if family.reasoning and prompt is reasoning.PromptReasoning.UNOPENED:
        start = [
            f"start: think? {answer}",
            f"think: {reasoning.THINK_OPEN} THOUGHT {reasoning.THINK_CLOSE}",
            r"THOUGHT: /(.|\n)*/",
        ]
    return common_pb2.ResponseFormat(ebnf="\n".join(["%llguidance {}", *start, *body]) + "\n")


def forced_grammar(
    family: ModelFamily,
    tools: ToolSchemas,
    *,
    parallel: bool,
    prompt: reasoning.PromptReasoning = reasoning.PromptReasoning.UNOPENED,
) -> common_pb2.ResponseFormat:
    """Output that is only calls of ``tools`` (each schema enforced), written as the family's template
    renders a turn of calls: one call, or with ``parallel`` one or more."""
    if family.tool_format is ToolFormat.KIMI_K2:
        _, rules = _kimi_k2_rules(tools, parallel)
        # K2's template writes an empty think block before the calls of a turn without reasoning
        # (where its generation prompt has not already begun one); rules[0] is the free-text
        # lexeme, not needed when the answer is the section alone.
        start = "start: section"
        if prompt is reasoning.PromptReasoning.UNOPENED:
            start = f"start: {reasoning.THINK_OPEN} {reasoning.THINK_CLOSE} section"
        rules = rules[1:]
    else:
        # The generic rendering: each call "<tool_call>\n{...}\n</tool_call>", calls joined by "\n".
        opening, closing = _literal(hermes.OPEN + "\n"), _literal("\n" + hermes.CLOSE)
        rules = [f"call: {opening} ({_choice(len(tools))}) {closing}", *_hermes_calls(tools)]
        start = 'start: call ("\\n" call)*' if parallel else "start: call"
    return common_pb2.ResponseFormat(ebnf="\n".join(["%llguidance {}", start, *rules]) + "\n")


def _arguments(schema: dict[str, Any]) -> str:
    return "%json " + json.dumps(schema | _AS_RENDERED)


def _literal(text: str) -> str:
    return json.dumps(text)  # a Lark string literal has JSON's escapes


def _choice(count: int) -> str:
    return " | ".join(f"call_{index}" for index in range(count))


def _hermes_rules(tools: ToolSchemas, parallel: bool) -> tuple[str, list[str]]:
    rules = [
        f"text_then_call[lazy]: ANY {_literal(hermes.OPEN)}",
        r"ANY: /(.|\n)*/",
        # The text after the last call never holds the tag: written, it must start a call.
        rf"TEXT: /(.|\n)*/ & ~/(.|\n)*{_regex_literal(hermes.OPEN)}(.|\n)*/",
        f'call: "\\n"? ({_choice(len(tools))}) "\\n"? {_literal(hermes.CLOSE)}',
        *_hermes_calls(tools),
    ]
    return f"(text_then_call call){'*' if parallel else '?'} TEXT", rules


def _hermes_calls(tools: ToolSchemas) -> list[str]:
    """One rule per tool: its call object, name first (the order the parsers stream)."""
    rules = []
    for index, (tool, parameters) in enumerate(tools):
        opening = _literal('{"name": ' + json.dumps(tool.name) + ', "arguments": ')
        rules.append(f'call_{index}: {opening} {_arguments(parameters)} "}}"')
    return rules


def _kimi_k2_rules(tools: ToolSchemas, parallel: bool) -> tuple[str, list[str]]:
    rules = [
        r"TEXT: /(.|\n)*/",
        f"section: {kimi_k2.SECTION_BEGIN} call{'+' if parallel else ''} {kimi_k2.SECTION_END}",
        f"call: {kimi_k2.CALL_BEGIN} ({_choice(len(tools))}) {kimi_k2.CALL_END}",
    ]
    for index, (tool, parameters) in enumerate(tools):
        rules.append(
            f"call_{index}: {_literal(f'functions.{tool.name}:')} /[0-9]{{1,6}}/"
            f" {kimi_k2.ARGUMENT_BEGIN} {_arguments(parameters)}"
        )
    return f"TEXT (section TEXT){'*' if parallel else '?'}", rules


def _regex_literal(text: str) -> str:
    """``text`` matched literally inside a Lark ``/regex/``."""
    return "".join(f"\\{char}" if char in r"\/.^$|?*+()[]{}" else char for char in text)
