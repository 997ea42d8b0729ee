"""Kimi's released tokenizer layout, for the tiny Kimi K2.5: ``tiktoken.model``,
``tokenizer_config.json`` with Kimi's added tokens, and ``chat_template.jinja``.

Moonshot ships K2 / K2.5 with a tiktoken vocabulary (``<base64 bytes> <rank>`` lines) and the
tokenizer as remote code (``tokenization_kimi.py``, not written here: Cachet runs no remote code,
and ``cachet.tokenizer.tiktoken_files`` rebuilds the tokenizer from these files). The ranks here
are not Kimi's 163,584 but come from a byte-level BPE ``tokenizer.json`` (SmolLM2's, which the
tiny models use): each token as its raw bytes, the 256 single bytes first (rank = byte value),
then each merge's result in merge order. tiktoken merges the lowest-rank pair, so a merge learnt
earlier still joins first. The added tokens take the ids after the ranks at the offsets of K2.5's
published ``tokenizer_config.json`` (163,584 + offset there):

    offset  0 [BOS]   1 [EOS]   2 <|im_end|>   3 <|im_user|>   4 <|im_assistant|>
           10 <|im_system|>   11..15 the tool-call markers   17 <|im_middle|>
           18 <|media_begin|>   19 <|media_content|>   20 <|media_end|>   21 <|media_pad|>
           22 <think>   23 </think>   (not special)        254 [UNK]   255 [PAD]

and the other reserved ids of the 258 stay unnamed (``<|reserved_token_{id}|>``).
"""

from __future__ import annotations

import base64
import json
from importlib.resources import files
from pathlib import Path
from typing import Any

from cachet.models._fs import write_json
from cachet.models.gguf_tokenizer import bytes_to_unicode

TIKTOKEN_FILE = "tiktoken.model"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
KIMI_K25_TEMPLATE = "kimi-k2.5.jinja"
# tokenization_kimi.py reserves 256 ids after the ranks, plus 2.
NUM_RESERVED_IDS = 256 + 2
KIMI_ADDED_TOKENS = {
    0: "[BOS]",
    1: "[EOS]",
    2: "<|im_end|>",
    3: "<|im_user|>",
    4: "<|im_assistant|>",
    10: "<|im_system|>",
    11: "<|tool_calls_section_begin|>",
    12: "<|tool_calls_section_end|>",
    13: "<|tool_call_begin|>",
    14: "<|tool_call_argument_begin|>",
    15: "<|tool_call_end|>",
    17: "<|im_middle|>",
    18: "<|media_begin|>",
    19: "<|media_content|>",
    20: "<|media_end|>",
    21: "<|media_pad|>",
    22: "<think>",
    23: "</think>",
    254: "[UNK]",
    255: "[PAD]",
}
# Plain added tokens: one id each, yet kept by decode(skip_special_tokens=True), where a reasoning
# parser looks for them.
NOT_SPECIAL = ("<think>", "</think>")


def ranks_from_byte_level_bpe(tokenizer_json: Path) -> dict[bytes, int]:
    """tiktoken ranks for the vocabulary of a byte-level BPE ``tokenizer.json`` (see above); its
    added tokens are left out."""
    model = json.loads(Path(tokenizer_json).read_text(encoding="utf-8"))["model"]
    if model.get("type") != "BPE":
        raise ValueError(f"{tokenizer_json}: a byte-level BPE is needed, not {model.get('type')}")
    to_byte = {char: byte for byte, char in bytes_to_unicode().items()}
    ranks = {bytes([byte]): byte for byte in range(256)}
    for merge in model["merges"]:
        left, right = merge.split(" ") if isinstance(merge, str) else merge
        try:
            token = bytes(to_byte[char] for char in left + right)
        except KeyError:
            raise ValueError(f"{tokenizer_json}: merge {merge!r} is not byte-level") from None
        ranks.setdefault(token, len(ranks))  # a token made by two merges keeps the first rank
    return ranks


def write_kimi_tokenizer(out_dir: Path, ranks: dict[bytes, int]) -> dict[str, Any]:
    """Write the three files into ``out_dir``; return the special-token description the tiny
    writers take (``gguf_tokenizer.special_tokens_from_hf_dir``'s shape)."""
    lines = (f"{base64.b64encode(token).decode()} {rank}" for token, rank in sorted(ranks.items(), key=_rank))
    (out_dir / TIKTOKEN_FILE).write_text("\n".join(lines) + "\n", encoding="ascii")
    ids = added_token_ids(len(ranks))
    write_json(out_dir / "tokenizer_config.json", _tokenizer_config(ids))
    (out_dir / CHAT_TEMPLATE_FILE).write_text(kimi_k25_chat_template(), encoding="utf-8")
    named = {"bos_token": "[BOS]", "eos_token": "[EOS]", "unk_token": "[UNK]", "pad_token": "[PAD]"}
    return {
        "ids": {key: ids[text] for key, text in named.items()},
        "tokens": named,
        # The end of a chat turn first, then the end of a document.
        "eos_token_ids": [ids["<|im_end|>"], ids["[EOS]"]],
        "add_bos_token": False,
        "add_eos_token": False,
    }


def added_token_ids(num_ranks: int) -> dict[str, int]:
    return {text: num_ranks + offset for offset, text in KIMI_ADDED_TOKENS.items()}


def kimi_k25_chat_template() -> str:
    """The tiny K2.5's chat template (package data; its header says where it comes from)."""
    return (files("cachet.models") / "templates" / KIMI_K25_TEMPLATE).read_text(encoding="utf-8")


def _tokenizer_config(ids: dict[str, int]) -> dict[str, Any]:
    return {
        "added_tokens_decoder": {
            str(token_id): {
                "content": text,
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": text not in NOT_SPECIAL,
            }
            for text, token_id in ids.items()
        },
        "bos_token": "[BOS]",
        "eos_token": "[EOS]",
        "unk_token": "[UNK]",
        "pad_token": "[PAD]",
        "clean_up_tokenization_spaces": False,
        "model_max_length": 1000000000000000019884624838656,
        "tokenizer_class": "TikTokenTokenizer",
    }


def _rank(item: tuple[bytes, int]) -> int:
    return item[1]
