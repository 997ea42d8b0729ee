"""Kimi's tiktoken tokenizer (``tiktoken.model`` + ``tokenizer_config.json``) as a fast tokenizer.

Moonshot ships its vocabulary as a tiktoken rank file and the tokenizer as remote code
(``tokenization_kimi.py``, which needs ``trust_remote_code`` and the ``tiktoken``
package). Cachet runs no remote code and hands the router a Rust tokenizer, so the
same tokenizer is rebuilt here in the tokenizers library:

- ``tiktoken.model``: one ``<base64 bytes> <rank>`` line per token; ranks are ids.
- tiktoken merges the adjacent pair whose joined bytes have the lowest rank, and takes a
  whole pre-token when it is itself a token. A byte-level BPE whose merges are ordered by
  the rank of their result (``ignore_merges`` for the whole-piece rule) encodes alike.
- The split regex is ``tokenization_kimi.py``'s (it is code there, not data).
- Special tokens take the ``NUM_RESERVED_SPECIAL_TOKENS`` ids after the ranks, named by
  ``added_tokens_decoder`` or ``<|reserved_token_{id}|>``; text that spells one encodes as
  that token, as Kimi's own ``encode`` does (``allowed_special="all"``). One marked
  ``"special": false`` there (K2's ``<think>``, ``</think>``) stays in text decoded with
  ``skip_special_tokens``, where a reasoning parser looks for it.

The engine reads the same files for stop strings and grammars (``tiktoken_tokenizer``: the
Rust tokenizer alone, without transformers).
"""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

TIKTOKEN_FILE = "tiktoken.model"
# tokenization_kimi.py reserves 256 ids after the ranks, plus 2.
NUM_RESERVED_SPECIAL_TOKENS = 256 + 2
KIMI_SPLIT_PATTERN = "|".join(
    [
        r"[\p{Han}]+",
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*"
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
        r"\p{N}{1,3}",
        r" ?[^\s\p{L}\p{N}]+[\r\n]*",
        r"\s*[\r\n]+",
        r"\s+(?!\S)",
        r"\s+",
    ]
)
_SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token")


def has_tiktoken_files(path: Path) -> bool:
    """A tiktoken checkpoint: the rank file and no tokenizer.json (which would win)."""
    return (path / TIKTOKEN_FILE).is_file() and not (path / "tokenizer.json").is_file()


def read_ranks(path: Path) -> dict[bytes, int]:
    ranks: dict[bytes, int] = {}
    for number, line in enumerate(path.read_text(encoding="ascii").splitlines(), 1):
        if not line.strip():
            continue
        try:
            token, rank = line.split()
            ranks[base64.b64decode(token, validate=True)] = int(rank)
        except ValueError:
            raise ValueError(f"{path}:{number}: not a '<base64> <rank>' line") from None
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise ValueError(f"{path}: ranks are not 0..{len(ranks) - 1}, each once")
    return ranks


def tiktoken_tokenizer(path: Path) -> Tokenizer:
    """The checkpoint's vocabulary and special tokens as a Rust tokenizer."""
    ranks = read_ranks(path / TIKTOKEN_FILE)
    tokenizer = _bpe_tokenizer(ranks)
    # add_tokens keeps each token's own special flag; ids follow the ranks in order.
    tokenizer.add_tokens(_special_tokens(_read_json(path / "tokenizer_config.json"), len(ranks)))
    return tokenizer


def load_tiktoken_tokenizer(path: Path) -> PreTrainedTokenizerFast:
    """The checkpoint's tokenizer, chat template included, as a transformers fast tokenizer."""
    from transformers import PreTrainedTokenizerFast

    config = _read_json(path / "tokenizer_config.json")
    tokenizer = tiktoken_tokenizer(path)
    template = config.get("chat_template")
    if template is None and (path / "chat_template.jinja").is_file():
        template = (path / "chat_template.jinja").read_text(encoding="utf-8")
    named = {key: _content(config[key]) for key in _SPECIAL_TOKEN_KEYS if config.get(key)}
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        chat_template=template,
        clean_up_tokenization_spaces=False,
        model_max_length=config.get("model_max_length", 1 << 60),
        **named,
    )


def _bpe_tokenizer(ranks: dict[bytes, int]) -> Tokenizer:
    to_text = _byte_to_text()

    def text(token: bytes) -> str:
        return "".join(to_text[b] for b in token)

    vocab = {text(token): rank for token, rank in ranks.items()}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=_merges(ranks, text), ignore_merges=True))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(KIMI_SPLIT_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def _merges(ranks: dict[bytes, int], text) -> list[tuple[str, str]]:
    """Every way to build each token from two tokens, ordered by the rank of the result, then of
    the parts: merging by that order joins a piece's bytes as tiktoken's lowest-rank-first loop does."""
    merges = []
    for token, rank in ranks.items():
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in ranks and right in ranks:
                merges.append((rank, ranks[left], ranks[right], text(left), text(right)))
    merges.sort()
    return [(left, right) for *_, left, right in merges]


def _byte_to_text() -> dict[int, str]:
    """GPT-2's byte-level alphabet: every byte as one printable character (what ByteLevel decodes)."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    mapping = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


def _special_tokens(config: dict[str, Any], first_id: int) -> list[AddedToken]:
    """The reserved ids' tokens in id order, from ``first_id``."""
    named = {int(i): token for i, token in (config.get("added_tokens_decoder") or {}).items()}
    outside = sorted(i for i in named if not first_id <= i < first_id + NUM_RESERVED_SPECIAL_TOKENS)
    if outside:
        raise ValueError(
            f"added_tokens_decoder ids {outside} fall outside the reserved special ids "
            f"{first_id}..{first_id + NUM_RESERVED_SPECIAL_TOKENS - 1}"
        )
    return [
        AddedToken(
            _content(named.get(i, f"<|reserved_token_{i}|>")),
            special=_is_special(named.get(i)),
            normalized=False,
        )
        for i in range(first_id, first_id + NUM_RESERVED_SPECIAL_TOKENS)
    ]


def _is_special(token: str | dict[str, Any] | None) -> bool:
    return not isinstance(token, dict) or token.get("special", True) is not False


def _content(token: str | dict[str, Any]) -> str:
    return token if isinstance(token, str) else token["content"]


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
