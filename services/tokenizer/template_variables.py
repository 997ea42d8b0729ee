"""Reasoning controls as chat-template variables, checked against what the template reads.

A Jinja template ignores a variable it never mentions: a control handed to a model whose
template does not read it would render the very prompt no control renders, and the caller
would never learn that it did nothing. So each control is refused (naming its field) unless
the template's free variables, ``jinja2.meta.find_undeclared_variables`` over its parsed
source, include the variable the control sets. vLLM passes them through unchecked.

- ``reasoning_effort`` (OpenAI; Responses' ``reasoning.effort``) is the variable of that name
  (gpt-oss templates read it).
- ``thinking`` (Anthropic's, Moonshot's) sets whichever switch the template declares:
  Qwen3's ``enable_thinking`` or Kimi's ``thinking``.
- ``chat_template_kwargs`` (vLLM's) names template variables itself; they win over the above.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.parser
from jinja2 import meta
from jinja2.sandbox import ImmutableSandboxedEnvironment

from cachet.common.v1 import common_pb2
from cachet.errors import InvalidArgument

# The switches templates read to think or not, in the order they are looked for.
THINKING_SWITCHES = ("enable_thinking", "thinking")
# Names the rendering call sets itself, or that transformers' apply_chat_template takes as its
# own arguments rather than handing them to the template.
RESERVED = frozenset(
    {
        "messages",
        "tools",
        "documents",
        "add_generation_prompt",
        "continue_final_message",
        "chat_template",
        "tokenize",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
        "sanitize_control_tokens",
    }
)


@dataclass(frozen=True)
class ReasoningControls:
    """What the caller asked of the template; empty asks nothing."""

    effort: str = ""
    thinking: bool | None = None
    template_kwargs: tuple[tuple[str, Any], ...] = ()

    @classmethod
    def from_proto(cls, controls: common_pb2.ReasoningControls) -> ReasoningControls:
        return cls(
            effort=controls.effort,
            thinking=controls.thinking if controls.HasField("thinking") else None,
            template_kwargs=tuple((v.name, _value(v)) for v in controls.template_kwargs),
        )

    def variables_for(self, source: str, model_id: str) -> dict[str, Any]:
        """The template variables these controls set, once ``source`` is seen to read each one."""
        reads = template_reads(source)
        variables: dict[str, Any] = {}
        if self.effort:
            if "reasoning_effort" not in reads:
                raise _unread("reasoning_effort", model_id, "reasoning_effort")
            variables["reasoning_effort"] = self.effort
        if self.thinking is not None:
            switch = next((name for name in THINKING_SWITCHES if name in reads), None)
            if switch is None:
                raise _unread("thinking", model_id, " or ".join(THINKING_SWITCHES))
            variables[switch] = self.thinking
        for name, value in self.template_kwargs:
            field = f"chat_template_kwargs.{name}"
            if name in RESERVED:
                raise InvalidArgument(f"{field}: {name!r} is set by Cachet, not by the caller", param=field)
            if name not in reads:
                raise _unread(field, model_id, name)
            variables[name] = value
        return variables


NO_CONTROLS = ReasoningControls()


def _value(variable: common_pb2.TemplateVariable) -> Any:
    kind = variable.WhichOneof("value")
    if kind is None:
        field = f"chat_template_kwargs.{variable.name}"
        raise InvalidArgument(f"{field}: a value is required", param=field)
    return getattr(variable, kind)


def _unread(field: str, model_id: str, variable: str) -> InvalidArgument:
    return InvalidArgument(
        f"{field}: the chat template of {model_id} does not read {variable}, so it would change nothing",
        param=field,
    )


class _GenerationTag(jinja2.ext.Extension):
    """Parses transformers' ``{% generation %}...{% endgeneration %}`` (assistant-mask markers)."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body).set_lineno(lineno)


_PARSER = ImmutableSandboxedEnvironment(extensions=[_GenerationTag, jinja2.ext.loopcontrols])


@functools.lru_cache(maxsize=64)
def template_reads(source: str) -> frozenset[str]:
    """The variables ``source`` reads that it does not set itself. Cached: a model has a few templates."""
    try:
        return frozenset(meta.find_undeclared_variables(_PARSER.parse(source)))
    except jinja2.TemplateSyntaxError:
        # Rendering fails on it too, and says so; here it reads nothing a control could set.
        return frozenset()
