"""Kimi's tiktoken files (``tiktoken.model`` + ``tokenizer_config.json``) through the tokenizer service.

The rank file is made here: a byte-level BPE trained by the tokenizers library on a
small multilingual text, written as tiktoken's ``<base64> <rank>`` lines, with Kimi's
layout of special tokens (the 258 ids after the ranks, some named). The service's
tokenizer must encode as tiktoken does: checked against a plain-Python rendering of
tiktoken's rule (split by Kimi's regex, then merge the lowest-rank adjacent pair) and,
where the ``tiktoken`` package is installed, against tiktoken itself. The tiny kimi-k2.5
checkpoint's files (``cachet.models.kimi_tiktoken``: ranks from SmolLM2's vocabulary, K2.5's
added tokens and chat template) are checked the same way.
"""

from __future__ import annotations

import base64
import json
from pathlib import Path

import pytest
import regex
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from cachet.models import kimi_tiktoken
from cachet.models.tiny import kimi_k2_chat_template
from cachet.tokenizer.template_variables import ReasoningControls
from cachet.tokenizer.tiktoken_files import (
    KIMI_SPLIT_PATTERN,
    NUM_RESERVED_SPECIAL_TOKENS,
    has_tiktoken_files,
    read_ranks,
)
from cachet.tokenizer.tokenizer_model import TokenizerModel

CORPUS = [
    "The quick brown fox doesn't jump; it's 2026 and we've 12345 foxes.",
    "def encode(self, text: str) -> list[int]:\n    return [ord(c) for c in text]\n\n",
    "月之暗面发布了新的模型，它可以理解图片和文字。中文文本没有空格。",
    "日本語のテキストも少し。カタカナとひらがな。",
    "Ünïcödé, naïve café — résumé!  Tabs\tand   spaces\r\nand CRLF.",
    "emoji 🙂🚀 and numbers 3.14159 1,000,000 0x1F",
    "SHOUTING WORDS AND CamelCase and snake_case_names",
]
TEXTS = [
    *CORPUS,
    "Hello world! I'M here, they'LL see.   \n\n  trailing  ",
    "混合 mixed 文本 text 123456789",
    "<|im_user|>user<|im_middle|>hi<|im_end|>[EOS]",
    "<think>hmm</think>answer",
    "unseen words: zyzzyva quixotic Ω≈ç√",
    "",
]
# At the offsets of Kimi's published tokenizer_config.json (163584 + offset).
SPECIALS = {
    0: "[BOS]",
    1: "[EOS]",
    2: "<|im_end|>",
    3: "<|im_user|>",
    4: "<|im_assistant|>",
    10: "<|im_system|>",
    17: "<|im_middle|>",
}
# Listed with "special": false (K2 Thinking's reasoning markers): still one token each.
PLAIN_ADDED = {22: "<think>", 23: "</think>"}


def _byte_level_to_bytes() -> dict[str, int]:
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    to_char = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in to_char:
            to_char[b] = chr(256 + extra)
            extra += 1
    assert set(to_char.values()) == set(alphabet)
    return {c: b for b, c in to_char.items()}


def write_kimi_tokenizer(out_dir: Path, vocab_size: int = 900) -> dict[bytes, int]:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tokenizer.train_from_iterator(CORPUS * 20, trainer)
    to_byte = _byte_level_to_bytes()
    ranks = {bytes(to_byte[c] for c in token): i for token, i in tokenizer.get_vocab().items()}
    out_dir.mkdir(parents=True)
    lines = [
        f"{base64.b64encode(token).decode()} {rank}"
        for token, rank in sorted(ranks.items(), key=lambda kv: kv[1])
    ]
    (out_dir / "tiktoken.model").write_text("\n".join(lines) + "\n")
    first = len(ranks)
    config = {
        "tokenizer_class": "TikTokenTokenizer",
        "auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]},
        "bos_token": "[BOS]",
        "eos_token": "[EOS]",
        "added_tokens_decoder": {
            **{str(first + i): {"content": t, "special": True} for i, t in SPECIALS.items()},
            **{str(first + i): {"content": t, "special": False} for i, t in PLAIN_ADDED.items()},
        },
        "chat_template": kimi_k2_chat_template(),
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config))
    (out_dir / "config.json").write_text(
        json.dumps({"model_type": "kimi_k2", "max_position_embeddings": 4096})
    )
    return ranks


def reference_encode(text: str, ranks: dict[bytes, int], specials: dict[str, int]) -> list[int]:
    """tiktoken's rule, in plain Python."""
    ids: list[int] = []
    for part in regex.split("(" + "|".join(map(regex.escape, specials)) + ")", text):
        if part in specials:
            ids.append(specials[part])
            continue
        for piece in regex.findall(KIMI_SPLIT_PATTERN, part, flags=regex.V1):
            parts = [bytes([b]) for b in piece.encode()]
            while len(parts) > 1:
                joined = [(ranks.get(parts[i] + parts[i + 1]), i) for i in range(len(parts) - 1)]
                candidates = [(rank, i) for rank, i in joined if rank is not None]
                if not candidates:
                    break
                _, i = min(candidates)
                parts[i : i + 2] = [parts[i] + parts[i + 1]]
            ids.extend(ranks[p] for p in parts)
    return ids


@pytest.fixture(scope="module")
def kimi_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("kimi-tiktoken") / "tok"
    write_kimi_tokenizer(path)
    return path


@pytest.fixture(scope="module")
def model(kimi_dir: Path) -> TokenizerModel:
    return TokenizerModel.load("tiny-kimi-tiktoken", kimi_dir)


def _specials(kimi_dir: Path) -> dict[str, int]:
    """Every added token: tiktoken's special_tokens, as tokenization_kimi.py builds them."""
    first = len(read_ranks(kimi_dir / "tiktoken.model"))
    return {t: first + i for i, t in (SPECIALS | PLAIN_ADDED).items()}


@pytest.mark.parametrize("text", TEXTS)
def test_encodes_as_tiktoken_rule(text: str, kimi_dir: Path, model: TokenizerModel) -> None:
    ranks = read_ranks(kimi_dir / "tiktoken.model")
    assert model.encode(text, add_special_tokens=False) == reference_encode(text, ranks, _specials(kimi_dir))
    assert model.decode(model.encode(text, add_special_tokens=False), skip_special_tokens=False) == text


def test_encodes_as_tiktoken_itself(kimi_dir: Path, model: TokenizerModel) -> None:
    """Where the tiktoken package is installed (it is no dependency of Cachet)."""
    tiktoken = pytest.importorskip("tiktoken")
    ranks = read_ranks(kimi_dir / "tiktoken.model")
    encoding = tiktoken.Encoding(
        name="kimi-test",
        pat_str=KIMI_SPLIT_PATTERN,
        mergeable_ranks=ranks,
        special_tokens=_specials(kimi_dir),
    )
    for text in TEXTS:
        assert model.encode(text, add_special_tokens=False) == encoding.encode(text, allowed_special="all"), (
            text
        )


def test_special_tokens_take_the_reserved_ids(kimi_dir: Path, model: TokenizerModel) -> None:
    first = len(read_ranks(kimi_dir / "tiktoken.model"))
    info = model.info
    assert info.vocab_size == first + NUM_RESERVED_SPECIAL_TOKENS
    by_text = {s.text: s.token_id for s in info.special_tokens}
    assert {t: by_text[t] for t in SPECIALS.values()} == {t: first + i for i, t in SPECIALS.items()}
    assert by_text[f"<|reserved_token_{first + 5}|>"] == first + 5
    assert info.bos_token_id == first
    assert first + 1 in info.stop_token_ids and first + 2 in info.stop_token_ids  # [EOS], <|im_end|>
    assert info.context_window == 4096
    ids = model.encode("a<|im_end|>b", add_special_tokens=False)
    assert model.decode(ids, skip_special_tokens=True) == "ab"


def test_added_tokens_marked_not_special_survive_skip_special_tokens(
    kimi_dir: Path, model: TokenizerModel
) -> None:
    """A reasoning parser reads <think> in text decoded with skip_special_tokens."""
    first = len(read_ranks(kimi_dir / "tiktoken.model"))
    ids = model.encode("<think>hmm</think>ok<|im_end|>", add_special_tokens=False)
    assert ids[0] == first + 22 and first + 23 in ids
    assert model.decode(ids, skip_special_tokens=True) == "<think>hmm</think>ok"
    assert "<think>" not in {s.text for s in model.info.special_tokens}
    # Still named in the model's description: the router constrains an answer after </think>.
    added = {s.text: s.token_id for s in model.info.added_tokens}
    assert (added["<think>"], added["</think>"]) == (first + 22, first + 23)


def test_chat_template_renders_to_kimi_turn_tokens(model: TokenizerModel, kimi_dir: Path) -> None:
    rendered = model.apply_chat_template(
        [{"role": "user", "content": "你好"}], [], add_generation_prompt=True, continue_final_message=False
    )
    specials = _specials(kimi_dir)
    assert rendered.prompt.endswith(
        "<|im_user|>user<|im_middle|>你好<|im_end|><|im_assistant|>assistant<|im_middle|>"
    )
    assert rendered.token_ids[0] == specials["<|im_system|>"]
    assert rendered.token_ids.count(specials["<|im_end|>"]) == 2  # the default system turn's and the user's
    assert rendered.token_ids[-1] == specials["<|im_middle|>"]


def test_a_tokenizer_json_beside_the_rank_file_wins(kimi_dir: Path, tmp_path: Path) -> None:
    assert has_tiktoken_files(kimi_dir)
    (tmp_path / "tiktoken.model").write_text("")
    (tmp_path / "tokenizer.json").write_text("{}")
    assert not has_tiktoken_files(tmp_path)


def test_a_malformed_rank_file_names_its_line(tmp_path: Path) -> None:
    (tmp_path / "tiktoken.model").write_text("IQ== 0\nnot-base64!! 1\n")
    with pytest.raises(ValueError, match=r"tiktoken.model:2: not a '<base64> <rank>' line"):
        read_ranks(tmp_path / "tiktoken.model")


def test_tool_definitions_render_with_sorted_keys_as_kimis_tokenizer_does(model: TokenizerModel) -> None:
    def tool(order: list[str]) -> dict:
        function = {"name": "get_weather", "description": "Weather", "parameters": {"type": "object"}}
        return {"type": "function", "function": {key: function[key] for key in order}}

    messages = [{"role": "user", "content": "weather?"}]
    one, other = (
        model.apply_chat_template(
            messages, [tool(order)], add_generation_prompt=True, continue_final_message=False
        ).prompt
        for order in (["name", "parameters", "description"], ["parameters", "description", "name"])
    )
    assert one == other
    assert '"function": {"description": "Weather", "name": "get_weather", "parameters"' in one


def test_the_exported_rust_tokenizer_decodes_and_encodes_alike(model: TokenizerModel) -> None:
    """The router rebuilds the tokenizer from ``tokenizer_json`` to detokenize streams."""
    exported = Tokenizer.from_str(model.tokenizer_json())
    for text in TEXTS:
        ids = model.encode(text, add_special_tokens=False)
        assert exported.encode(text, add_special_tokens=False).ids == ids, text
        assert exported.decode(ids, skip_special_tokens=False) == text, text


@pytest.fixture(scope="module")
def tiny_k25_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny kimi-k2.5 checkpoint's tokenizer files, from the SmolLM2 vocabulary, without weights."""
    path = tmp_path_factory.mktemp("tiny-k25-tokenizer")
    kimi_tiktoken.write_kimi_tokenizer(
        path, kimi_tiktoken.ranks_from_byte_level_bpe(tiny_model_dir / "tokenizer.json")
    )
    (path / "config.json").write_text(
        json.dumps({"model_type": "deepseek_v3", "max_position_embeddings": 2048})
    )
    return path


@pytest.fixture(scope="module")
def tiny_k25(tiny_k25_dir: Path) -> TokenizerModel:
    return TokenizerModel.load("tiny-kimi-k2.5", tiny_k25_dir)


def test_the_tiny_kimi_k25_files_are_kimis_layout(tiny_k25_dir: Path, tiny_k25: TokenizerModel) -> None:
    assert sorted(p.name for p in tiny_k25_dir.iterdir()) == [
        "chat_template.jinja", "config.json", "tiktoken.model", "tokenizer_config.json"
    ]  # fmt: skip
    ranks = read_ranks(tiny_k25_dir / "tiktoken.model")
    assert all(ranks[bytes([b])] == b for b in range(256))
    assert ranks[b" the"] < ranks[b" question"]  # merged earlier: a lower rank
    first = len(ranks)
    by_text = {s.text: s.token_id for s in tiny_k25.info.special_tokens}
    assert {t: by_text.get(t) for t in ("[BOS]", "<|im_end|>", "<|im_middle|>", "<|media_pad|>", "[PAD]")} == {
        "[BOS]": first, "<|im_end|>": first + 2, "<|im_middle|>": first + 17, "<|media_pad|>": first + 21,
        "[PAD]": first + 255,
    }  # fmt: skip
    assert "<think>" not in by_text
    assert tiny_k25.encode("<think></think>", add_special_tokens=False) == [first + 22, first + 23]
    assert tiny_k25.info.vocab_size == first + NUM_RESERVED_SPECIAL_TOKENS
    assert set(tiny_k25.info.stop_token_ids) == {first + 1, first + 2}  # [EOS], <|im_end|>


def test_the_tiny_kimi_k25_tokenizer_encodes_as_tiktoken(
    tiny_k25_dir: Path, tiny_k25: TokenizerModel
) -> None:
    ranks = read_ranks(tiny_k25_dir / "tiktoken.model")
    specials = kimi_tiktoken.added_token_ids(len(ranks))
    for text in TEXTS:
        ids = tiny_k25.encode(text, add_special_tokens=False)
        assert ids == reference_encode(text, ranks, specials), text
        assert tiny_k25.decode(ids, skip_special_tokens=False) == text
    tiktoken = pytest.importorskip("tiktoken")
    encoding = tiktoken.Encoding(
        name="tiny-k25", pat_str=KIMI_SPLIT_PATTERN, mergeable_ranks=ranks, special_tokens=specials
    )
    for text in TEXTS:
        assert tiny_k25.encode(text, add_special_tokens=False) == encoding.encode(text, allowed_special="all")


def test_the_tiny_kimi_k25_template_opens_a_think_block_unless_thinking_is_off(
    tiny_k25: TokenizerModel,
) -> None:
    def render(messages: list[dict], tools: list[dict] = (), **reasoning: bool) -> str:
        return tiny_k25.apply_chat_template(
            messages,
            list(tools),
            add_generation_prompt=True,
            continue_final_message=False,
            reasoning=ReasoningControls(**reasoning),
        ).prompt

    user = {"role": "user", "content": "你好"}
    turn = "<|im_user|>user<|im_middle|>你好<|im_end|><|im_assistant|>assistant<|im_middle|>"
    default_system = (
        "<|im_system|>system<|im_middle|>You are Kimi, an AI assistant created by Moonshot AI.<|im_end|>"
    )
    assert render([user]) == default_system + turn + "<think>"
    assert render([user], thinking=True).endswith(turn + "<think>")
    assert render([user], thinking=False).endswith(turn + "<think></think>")
    # The last assistant turns keep their reasoning (unless thinking is off), older ones drop it.
    answered = [
        user,
        {"role": "assistant", "content": "a", "reasoning_content": "r1"},
        {"role": "user", "content": "b"},
        {"role": "assistant", "content": "", "reasoning_content": "r2", "tool_calls": [
            {"id": "functions.f:0", "type": "function", "function": {"name": "f", "arguments": "{}"}}
        ]},
        {"role": "tool", "tool_call_id": "functions.f:0", "content": "ok"},
    ]  # fmt: skip
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    prompt = render(answered, [tool])
    assert prompt.startswith(
        '<|im_system|>tool_declare<|im_middle|>[{"function":{"name":"f","parameters":{"type":"object"}},'
        '"type":"function"}]<|im_end|>' + default_system
    )
    assert "<|im_middle|><think></think>a<|im_end|>" in prompt
    assert (
        "<|im_middle|><think>r2</think><|tool_calls_section_begin|><|tool_call_begin|>functions.f:0" in prompt
    )
    assert "<|im_system|>tool<|im_middle|>## Return of functions.f:0\nok<|im_end|>" in prompt
    assert "<think>r2</think>" not in render(answered, [tool], thinking=False)
