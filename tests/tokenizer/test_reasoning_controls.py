"""Reasoning controls reach the chat template, and a template that does not read one refuses it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from cachet.common.v1 import common_pb2
from cachet.errors import InvalidArgument
from cachet.tokenizer.template_variables import ReasoningControls, template_reads
from cachet.tokenizer.tokenizer_model import TokenizerModel

THINKING_MODEL_ID = "tiny-thinking"
# Qwen3's switch and gpt-oss's effort, in a ChatML template; {% generation %} as transformers' own.
THINKING_TEMPLATE = """\
{%- if reasoning_effort is defined %}{{- '<|im_start|>system\\nReasoning: ' + reasoning_effort + '<|im_end|>\\n' }}{%- endif %}
{%- for message in messages %}
{%- if message.role == 'assistant' %}{{- '<|im_start|>assistant\\n' }}{% generation %}{{- message.content }}{% endgeneration %}{{- '<|im_end|>\\n' }}
{%- else %}{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}
{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}
{%- if tone is defined %}{{- '(' + tone + ')' }}{%- endif %}
{%- endif %}
"""
USER = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def thinking_model(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> TokenizerModel:
    target = tmp_path_factory.mktemp("thinking-model") / THINKING_MODEL_ID
    shutil.copytree(tiny_model_dir, target)
    config_path = target / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = THINKING_TEMPLATE
    config_path.write_text(json.dumps(config))
    return TokenizerModel.load(THINKING_MODEL_ID, target)


def render(model: TokenizerModel, controls: ReasoningControls) -> str:
    return model.apply_chat_template(
        USER, [], add_generation_prompt=True, continue_final_message=False, reasoning=controls
    ).prompt


def test_the_template_reads_its_free_variables_only() -> None:
    reads = template_reads(THINKING_TEMPLATE)
    assert {"messages", "reasoning_effort", "enable_thinking", "tone", "add_generation_prompt"} <= reads
    assert "message" not in reads  # the loop variable is set by the template itself


def test_thinking_off_reaches_qwens_switch(thinking_model: TokenizerModel) -> None:
    assert render(thinking_model, ReasoningControls()).endswith("<|im_start|>assistant\n")
    off = render(thinking_model, ReasoningControls(thinking=False))
    assert off.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert render(thinking_model, ReasoningControls(thinking=True)).endswith("<|im_start|>assistant\n")


def test_effort_and_template_kwargs_are_rendered(thinking_model: TokenizerModel) -> None:
    prompt = render(
        thinking_model,
        ReasoningControls(effort="high", template_kwargs=(("tone", "terse"), ("enable_thinking", False))),
    )
    assert prompt.startswith("<|im_start|>system\nReasoning: high<|im_end|>\n")
    assert prompt.endswith("<think>\n\n</think>\n\n(terse)")


def test_chat_template_kwargs_win_over_thinking(thinking_model: TokenizerModel) -> None:
    prompt = render(
        thinking_model, ReasoningControls(thinking=False, template_kwargs=(("enable_thinking", True),))
    )
    assert prompt.endswith("<|im_start|>assistant\n")


@pytest.mark.parametrize(
    ("controls", "param"),
    [
        (ReasoningControls(effort="low"), "reasoning_effort"),
        (ReasoningControls(thinking=True), "thinking"),
        (
            ReasoningControls(template_kwargs=(("enable_thinking", False),)),
            "chat_template_kwargs.enable_thinking",
        ),
    ],
)
def test_a_template_that_does_not_read_a_control_refuses_it(
    tiny_model: TokenizerModel, controls: ReasoningControls, param: str
) -> None:
    # SmolLM2's template reads none of them: rendering would silently ignore the control.
    with pytest.raises(InvalidArgument) as refused:
        render(tiny_model, controls)
    assert refused.value.param == param
    assert "does not read" in refused.value.message


def test_names_the_call_sets_are_refused(thinking_model: TokenizerModel) -> None:
    with pytest.raises(InvalidArgument) as refused:
        render(thinking_model, ReasoningControls(template_kwargs=(("add_generation_prompt", False),)))
    assert refused.value.param == "chat_template_kwargs.add_generation_prompt"


def test_from_proto_keeps_typed_values() -> None:
    proto = common_pb2.ReasoningControls(
        effort="medium",
        thinking=False,
        template_kwargs=[
            common_pb2.TemplateVariable(name="a", bool_value=True),
            common_pb2.TemplateVariable(name="b", int_value=3),
            common_pb2.TemplateVariable(name="c", string_value="x"),
            common_pb2.TemplateVariable(name="d", number_value=0.5),
        ],
    )
    controls = ReasoningControls.from_proto(proto)
    assert controls == ReasoningControls("medium", False, (("a", True), ("b", 3), ("c", "x"), ("d", 0.5)))
    assert ReasoningControls.from_proto(common_pb2.ReasoningControls()) == ReasoningControls()
