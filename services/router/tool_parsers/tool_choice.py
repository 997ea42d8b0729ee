"""``tool_choice`` (and ``parallel_tool_calls``) as a plan: which tools the prompt
offers, which grammar constrains the output, and how the output is read.

- none: the prompt offers no tools (earlier calls in the conversation still
  render) and the output is read as plain text.
- auto (the default when tools are given): tools offered; the model decides and
  the family's tool parser reads its calls.
- required / a named function: enforced by grammar, so the arguments always
  validate against the tool's ``parameters`` schema. The constraint is a JSON
  schema (the one grammar every engine backend takes as ``ResponseFormat``):

  - named ``f``: the output is ``f``'s arguments object; schema = f's parameters
    (``{}`` only, for a function whose parameters declare no properties).
  - required: the output is ``[{"name": ..., "arguments": {...}}, ...]`` with
    one ``anyOf`` branch per tool (``name`` a const, ``arguments`` its
    parameters), at least one item, at most one when ``parallel_tool_calls`` is
    false.

  The model is not told about this shape (the prompt keeps the family's own tool
  format); the grammar alone makes it write it. A forced turn's history is then
  re-rendered in the family's format, which is why it is not prefix-stable for
  the next turn the way an ``auto`` call is.

Tools marked ``strict`` are enforced the same way when forced, and a strict tool's
schema that uses keywords llguidance cannot enforce is refused here (INVALID_ARGUMENT
naming the tool) rather than silently half-enforced: the Lark grammars below cannot
ask the engine for that check the way a JSON-schema constraint does. Under ``auto``,
when any offered tool is strict, the constraint is a grammar in the model family's
call format (``call_grammar``): text stays free, but a call the model opens must
name an offered tool, with arguments valid for its schema when the tool is strict.
A ``response_format`` constraint on the same request wins (it shapes the whole
answer, and one grammar applies).

On Kimi K2, forced calls are written in its own call format instead of the JSON
shapes above (``call_grammar.kimi_k2_forced_grammar``; read by its own parser), so
they render back prefix-stably too. Both depend on the family, so the plan builds
the grammar once the family is known (``constraint_for``).
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
from cachet.router.tool_parsers.call_grammar import kimi_k2_forced_grammar, strict_auto_grammar
from cachet.router.tool_parsers.model_family import ModelFamily, ToolFormat
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
    constraint: common_pb2.ResponseFormat | None = None  # grammar for NAMED / REQUIRED
    # The tools a call may name with their parameters schemas, for grammars in the family's
    # format (forced calls on Kimi K2, strict tools under auto).
    call_schemas: tuple[tuple[common_pb2.Tool, dict[str, Any]], ...] = ()
    strict_auto: bool = False  # AUTO with strict tools: calls are checked by grammar
    parallel: bool = True  # parallel_tool_calls (a NAMED plan makes one call)

    def constraint_for(self, family: ModelFamily) -> common_pb2.ResponseFormat | None:
        """The grammar the engine enforces for this plan on a model of ``family``; None for free text."""
        if self.strict_auto:
            return strict_auto_grammar(family, self.call_schemas, parallel=self.parallel)
        if self.constraint is not None and family.tool_format is ToolFormat.KIMI_K2:
            return kimi_k2_forced_grammar(self.call_schemas, parallel=self.parallel)
        return self.constraint


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


def _schema_format(name: str, schema: dict[str, Any], strict: bool) -> common_pb2.ResponseFormat:
    # strict: the engine refuses schema keywords it cannot enforce instead of skipping them
    # (OpenAI's strict flag); the schemas built here use only supported ones.
    return common_pb2.ResponseFormat(
        json_schema=common_pb2.JsonSchemaFormat(
            name=name, schema_json=json.dumps(schema, separators=(",", ":")), strict=strict
        )
    )


def named_constraint(tools: list[common_pb2.Tool], name: str) -> common_pb2.ResponseFormat:
    index = next(i for i, tool in enumerate(tools) if tool.name == name)
    return _schema_format(name, _parameters(tools[index], index), tools[index].strict)


def required_constraint(tools: list[common_pb2.Tool], parallel: bool) -> common_pb2.ResponseFormat:
    calls = [
        {
            "type": "object",
            # Either key order parses; the calls are emitted whole, not streamed by key.
            "properties": {"name": {"const": tool.name}, "arguments": _parameters(tool, index)},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for index, tool in enumerate(tools)
    ]
    schema: dict[str, Any] = {"type": "array", "items": {"anyOf": calls}, "minItems": 1}
    if not parallel:
        schema["maxItems"] = 1
    return _schema_format("tool_calls", schema, all(tool.strict for tool in tools))


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
        return ToolPlan(
            ToolMode.NAMED, tuple(tools), names, name, named_constraint(tools, name), named, parallel=False
        )
    parallel = request.parallel_tool_calls if request.HasField("parallel_tool_calls") else True
    if forced:
        schemas = tuple((tool, _parameters(tool, index)) for index, tool in enumerate(tools))
        constraint = required_constraint(tools, parallel)
        return ToolPlan(ToolMode.REQUIRED, tuple(tools), names, "", constraint, schemas, parallel=parallel)
    strict = any(tool.strict for tool in tools) and request.response_format.WhichOneof("format") in (
        None,
        "text",
    )
    schemas = tuple((tool, _parameters(tool, index)) for index, tool in enumerate(tools)) if strict else ()
    return ToolPlan(ToolMode.AUTO, tuple(tools), names, "", None, schemas, strict, parallel)
