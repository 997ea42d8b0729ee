"""Fixtures of the tokenizer service tests: a tiny checkpoint with the real SmolLM2 tokenizer."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from cachet.models.tiny import write_tiny_model
from cachet.tokenizer.tokenizer_model import TokenizerModel

TINY_MODEL_ID = "tiny-llama"
TOOLS_MODEL_ID = "tiny-tools"

# A ChatML template that renders tools natively, in the shape of Qwen2.5's: tools as
# JSON in the system turn, calls with `arguments | tojson`, results in `tool` turns
# (consecutive ones share a user turn), reasoning replayed in <think> blocks.
TOOLS_TEMPLATE = """\
{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}
{{- '# Tools\\n<tools>' }}
{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}
{{- '\\n</tools><|im_end|>\\n' }}
{%- elif messages[0].role == 'system' %}
{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'system' and loop.first %}
{%- elif message.role == 'assistant' %}
{{- '<|im_start|>assistant\\n' }}
{%- if message.reasoning_content %}{{- '<think>' + message.reasoning_content + '</think>\\n' }}{%- endif %}
{{- message.content }}
{%- for call in message.tool_calls or [] %}
{{- '\\n<tool_call>\\n{"name": "' + call.function.name + '", "arguments": ' + (call.function.arguments | tojson) + '}\\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- elif message.role == 'tool' %}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
{{- '\\n<tool_response id="' + message.tool_call_id + '">\\n' + message.content + '\\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}
{%- else %}
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tokenizer-models") / TINY_MODEL_ID)


@pytest.fixture(scope="session")
def tiny_model(tiny_model_dir: Path) -> TokenizerModel:
    return TokenizerModel.load(TINY_MODEL_ID, tiny_model_dir)


@pytest.fixture(scope="session")
def tools_model_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with a chat template that supports tools natively."""
    target = tmp_path_factory.mktemp("tokenizer-tools-model") / TOOLS_MODEL_ID
    shutil.copytree(tiny_model_dir, target)
    config_path = target / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = TOOLS_TEMPLATE
    config_path.write_text(json.dumps(config))
    model_config = json.loads((target / "config.json").read_text())
    model_config["cachet_model_id"] = TOOLS_MODEL_ID
    (target / "config.json").write_text(json.dumps(model_config))
    return target


@pytest.fixture(scope="session")
def tools_model(tools_model_dir: Path) -> TokenizerModel:
    return TokenizerModel.load(TOOLS_MODEL_ID, tools_model_dir)
