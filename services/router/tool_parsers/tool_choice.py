"""``tool_choice`` (and ``parallel_tool_calls``) as a plan: which tools the prompt
offers, which grammar constrains the output, and how the output is read.

- none: the prompt offers no tools (earlier calls in the conversation still
  render) and the output is read as plain text.
- auto (the default when tools are given): tools offered; the model decides and
  the family's tool parser reads its calls. When any offered tool is ``strict``,
  a grammar in the family's call format keeps text free but makes every call it
  opens name an offered tool, with arguments valid for the schema of a strict
  one. A ``response_format`` constraint on the same request wins (it shapes the
  whole answer, and one grammar applies).
- required / a named function: enforced by grammar, so the arguments always
  validate against the tool's ``parameters`` schema. The output is only calls,
  written in the family's own format exactly as its chat template renders them
  back (``call_grammar.forced_grammar``): the family's parser reads them, and the
  next turn's prompt starts with this turn's tokens. Required allows one call
  when ``parallel_tool_calls`` is false; named makes one call.

Grammars depend on the family, so the plan builds them once it is known
(``constraint_for``). A strict tool's schema that uses keywords llguidance cannot
enforce is refused here (INVALID_ARGUMENT naming the tool) rather than half
enforced: a Lark grammar cannot ask the engine for that check the way a strict
JSON-schema ``response_format`` does.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from enum import Enum
from typing import Any

import llguidance

from cachet.common.v1 import common_pb2
from cachet.errors import InvalidArgument
from cachet.router.tool_parsers.call_grammar import forced_grammar, strict_auto_grammar
from cachet.router.tool_parsers.model_family import ModelFamily
from cachet.router.tool_parsers.reasoning import PromptReasoning
from cachet.router.v1 import router_pb2


class ToolMode(Enum):
    NONE = "none"  # no tools offered, no calls parsed
    AUTO = "auto"
    NAMED = "named"
    REQUIRED = "required"


@dataclass(frozen=True)
class ToolPlan:
    mode: ToolMode
    offered: tuple[common_pb2.Tool, ...]  # tools the prompt shows the model
    tool_names: frozenset[str]  # names a parsed call may carry
    forced_name: str = ""  # the function of a NAMED plan
    # The tools a call may name with their parameters schemas (NAMED, REQUIRED, strict AUTO).
    call_schemas: tuple[tuple[common_pb2.Tool, dict[str, Any]], ...] = ()
    strict_auto: bool = False  # AUTO with strict tools: calls are checked by grammar
    parallel: bool = True  # parallel_tool_calls (a NAMED plan makes one call)

    def constraint_for(
        self, family: ModelFamily, prompt: PromptReasoning = PromptReasoning.UNOPENED
    ) -> common_pb2.ResponseFormat | None:
        """The grammar the engine enforces for this plan on a model of ``family`` after a prompt that
        leaves reasoning ``prompt``; None for free text."""
        if self.mode in (ToolMode.NAMED, ToolMode.REQUIRED):
            return forced_grammar(family, self.call_schemas, parallel=self.parallel, prompt=prompt)
        if self.strict_auto:
            return strict_auto_grammar(family, self.call_schemas, parallel=self.parallel, prompt=prompt)
        return None


# A function that takes no arguments is called with {} (an open object would let a
# weak model invent keys until max_tokens).
_NO_ARGUMENTS = {"type": "object", "properties": {}, "additionalProperties": False}


def _parameters(tool: common_pb2.Tool, index: int) -> dict[str, Any]:
    if not tool.parameters_schema_json.strip():
        return dict(_NO_ARGUMENTS)
    try:
        schema = json.loads(tool.parameters_schema_json)
    except json.JSONDecodeError as error:
        raise InvalidArgument(
            f"tools[{index}].parameters is not valid JSON ({error.msg})", param=f"tools[{index}].parameters"
        ) from None
    if not isinstance(schema, dict):
        raise InvalidArgument(
            f"tools[{index}].parameters must be a JSON schema object", param=f"tools[{index}].parameters"
        )
    if (
        schema.get("type") == "object"
        and not schema.get("properties")
        and "additionalProperties" not in schema
    ):
        schema = _NO_ARGUMENTS | schema
    if tool.strict:
        _check_enforceable(json.dumps(schema), index)
    return schema


@functools.lru_cache(maxsize=256)
def _check_enforceable(schema_json: str, index: int) -> None:
    """A strict tool's schema must be enforced whole (OpenAI's ``strict``): refuse what llguidance skips.

    The family-format grammars (Lark) carry schemas the engine cannot hold to strict itself;
    asking llguidance here, without a tokenizer, gives the same verdict the engine would.
    """
    param = f"tools[{index}].parameters"
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema_json)
    except ValueError as error:
        raise InvalidArgument(f"{param} is not a usable JSON schema: {error}", param=param) from None
    _, problems = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, None)
    if problems:
        raise InvalidArgument(
            f"{param} of a strict tool uses what cannot be enforced: {'; '.join(problems)}", param=param
        )


def plan_tools(request: router_pb2.ChatCompletionRequest) -> ToolPlan:
    """The plan for ``request``; ``InvalidArgument`` for a choice that cannot be honoured."""
    tools = list(request.tools)
    names = frozenset(tool.name for tool in tools)
    choice = request.tool_choice.WhichOneof("choice")
    mode_value = request.tool_choice.mode if choice == "mode" else common_pb2.TOOL_CHOICE_MODE_UNSPECIFIED
    if not tools or mode_value == common_pb2.TOOL_CHOICE_MODE_NONE:
        if choice == "function_name" or mode_value == common_pb2.TOOL_CHOICE_MODE_REQUIRED:
            raise InvalidArgument(
                "tool_choice asks for a tool call but no tools are given", param="tool_choice"
            )
        return ToolPlan(ToolMode.NONE, (), frozenset())
    forced = choice == "function_name" or mode_value == common_pb2.TOOL_CHOICE_MODE_REQUIRED
    if forced and request.response_format.WhichOneof("format") not in (None, "text"):
        raise InvalidArgument(
            "a forced tool call (tool_choice required or a function) and a response_format "
            "constraint cannot both apply",
            param="response_format",
        )
    if choice == "function_name":
        name = request.tool_choice.function_name
        if name not in names:
            raise InvalidArgument(f"tool_choice names {name!r}, which is not in tools", param="tool_choice")
        index = next(i for i, tool in enumerate(tools) if tool.name == name)
        named = ((tools[index], _parameters(tools[index], index)),)
        return ToolPlan(ToolMode.NAMED, tuple(tools), names, name, named, parallel=False)
    parallel = request.parallel_tool_calls if request.HasField("parallel_tool_calls") else True
    free_text = request.response_format.WhichOneof("format") in (None, "text")
    strict = free_text and any(tool.strict for tool in tools)
    schemas = (
        tuple((tool, _parameters(tool, index)) for index, tool in enumerate(tools))
        if forced or strict
        else ()
    )
    if forced:
        return ToolPlan(ToolMode.REQUIRED, tuple(tools), names, "", schemas, parallel=parallel)
    return ToolPlan(ToolMode.AUTO, tuple(tools), names, "", schemas, strict, parallel)
