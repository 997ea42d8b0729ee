"""The tiny kimi-k2 checkpoint: K2's architecture, chat tokens and chat template on the SmolLM2 vocabulary."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer
from transformers import AutoConfig, AutoTokenizer, DeepseekV3Config
from typer.testing import CliRunner

from cachet.engine.models.config import ModelConfig
from cachet.models import write_tiny_model
from cachet.models.tiny import KIMI_K2_SPECIAL_TOKENS, KIMI_K2_THINK_TOKENS, kimi_k2_chat_template
from cachet.tools.cli import app

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]
CONVERSATION = [
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": "",
        "reasoning_content": "Call the tool.",
        "tool_calls": [
            {
                "id": "functions.get_weather:0",
                "type": "function",
                "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "functions.get_weather:0", "content": "18°C, sunny"},
]
# Written out by hand from the template's rules: tools declared first, the default system turn, the
# tool call in K2's section markers with the reasoning kept (it follows the last plain answer), the
# result as "## Return of <id>", and the open assistant turn.
EXPECTED = (
    '<|im_system|>tool_declare<|im_middle|>[{"type": "function", "function": {"name": "get_weather", '
    '"description": "Weather in a city", "parameters": {"type": "object", "properties": {"city": '
    '{"type": "string"}}, "required": ["city"]}}}]<|im_end|>'
    "<|im_system|>system<|im_middle|>You are Kimi, an AI assistant created by Moonshot AI.<|im_end|>"
    "<|im_user|>user<|im_middle|>Weather in Paris?<|im_end|>"
    "<|im_assistant|>assistant<|im_middle|><think>Call the tool.</think>"
    "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>"
    '{"city": "Paris"}<|tool_call_end|><|tool_calls_section_end|><|im_end|>'
    "<|im_system|>tool<|im_middle|>## Return of functions.get_weather:0\n18°C, sunny<|im_end|>"
    "<|im_assistant|>assistant<|im_middle|>"
)


@pytest.fixture(scope="module")
def kimi_dir(tmp_path_factory: pytest.TempPathFactory, tokenizer_cache: Path) -> Path:
    out = tmp_path_factory.mktemp("tiny") / "tiny-kimi-k2"
    return write_tiny_model(out, family="kimi-k2", tokenizer_cache_dir=tokenizer_cache)


def test_config_is_deepseek_v3_for_transformers_and_for_the_engine(kimi_dir: Path) -> None:
    raw = json.loads((kimi_dir / "config.json").read_text())
    assert raw["cachet_model_id"] == "tiny-kimi-k2"
    assert isinstance(AutoConfig.from_pretrained(kimi_dir), DeepseekV3Config)
    config = ModelConfig.from_model_dir(kimi_dir)
    assert config.mla is not None and config.moe is not None
    assert (config.moe.n_routed_experts, config.moe.n_shared_experts, config.moe.first_k_dense_replace) == (
        8,
        2,
        1,
    )
    assert (config.moe.scoring_func, config.moe.topk_method) == ("sigmoid", "noaux_tc")
    assert config.rope.rope_type == "yarn"
    # Vocabulary = SmolLM2's 49,152 + K2's tokens that SmolLM2 lacks (<|im_end|> is shared).
    added = len(KIMI_K2_SPECIAL_TOKENS) - 1 + len(KIMI_K2_THINK_TOKENS)
    assert config.vocab_size == 49152 + added
    im_end = Tokenizer.from_file(str(kimi_dir / "tokenizer.json")).token_to_id("<|im_end|>")
    assert config.eos_token_ids == (im_end,) == (2,)


def test_every_k2_token_is_one_id(kimi_dir: Path) -> None:
    tok = AutoTokenizer.from_pretrained(kimi_dir)
    for token in KIMI_K2_SPECIAL_TOKENS + KIMI_K2_THINK_TOKENS:
        ids = tok.encode(f"a{token}b", add_special_tokens=False)
        assert tok.convert_ids_to_tokens(ids).count(token) == 1, token
    # Reasoning markers survive skip_special_tokens (a text-level parser needs them); turn markers do not.
    ids = tok.encode("<think>x</think><|im_end|>", add_special_tokens=False)
    assert tok.decode(ids, skip_special_tokens=True) == "<think>x</think>"


def test_template_renders_tool_conversation(kimi_dir: Path) -> None:
    tok = AutoTokenizer.from_pretrained(kimi_dir)
    text = tok.apply_chat_template(CONVERSATION, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    assert text == EXPECTED
    ids = tok.apply_chat_template(CONVERSATION, tools=TOOLS, tokenize=True, add_generation_prompt=True)[
        "input_ids"
    ]
    markers = [i for i in ids if i in set(tok.convert_tokens_to_ids(list(KIMI_K2_SPECIAL_TOKENS)))]
    assert tok.convert_ids_to_tokens(markers)[:4] == [
        "<|im_system|>",
        "<|im_middle|>",
        "<|im_end|>",
        "<|im_system|>",
    ]
    assert tok.decode(ids) == EXPECTED


def test_template_ships_as_package_data(kimi_dir: Path) -> None:
    template = kimi_k2_chat_template()
    assert "<|tool_calls_section_begin|>" in template and "## Return of" in template
    assert json.loads((kimi_dir / "tokenizer_config.json").read_text())["chat_template"] == template


def test_cli_writes_the_family(tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["model", "tiny", str(tmp_path / "k2"), "--family", "kimi-k2"])
    assert result.exit_code == 0, result.output
    assert json.loads((tmp_path / "k2" / "config.json").read_text())["model_type"] == "deepseek_v3"
