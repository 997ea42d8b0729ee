"""Kimi's tiktoken files (``tiktoken.model`` + ``tokenizer_config.json``) through the tokenizer service.

The rank file is made here: a byte-level BPE trained by the tokenizers library on a
small multilingual text, written as tiktoken's ``<base64> <rank>`` lines, with Kimi's
layout of special tokens (the 258 ids after the ranks, some named). The service's
tokenizer must encode as tiktoken does: checked against a plain-Python rendering of
tiktoken's rule (split by Kimi's regex, then merge the lowest-rank adjacent pair) and,
where the ``tiktoken`` package is installed, against tiktoken itself.
"""

from __future__ import annotations

import base64
import json
from pathlib import Path

import pytest
import regex
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from cachet.models.tiny import kimi_k2_chat_template
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
