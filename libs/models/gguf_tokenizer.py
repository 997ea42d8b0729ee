"""The tokenizer a GGUF file describes, rebuilt as Hugging Face `tokenizer.json` files.

A GGUF carries no `tokenizer.json`: the vocabulary, merges, special ids and chat template live in
its metadata under llama.cpp's key names. Reading only that metadata (no tensor is touched) takes a
few seconds, so the result is cached per GGUF file and every later tiny checkpoint copies it.

Both the converted default model and the tiny test models get their tokenizer from here, so the two
always tokenize alike.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import shutil
import struct
import tempfile
import unicodedata
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

from cachet.models._fs import write_json

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens.json")

# llama.cpp's token types (tokenizer.ggml.token_type).
_CONTROL = 3
_USER_DEFINED = 4

# Pre-tokenizer names (tokenizer.ggml.pre) whose vocabularies were trained on text with every digit
# cut off on its own before the GPT-2 split; llama.cpp does the same for them. transformers' own GGUF
# conversion forgets this step, which changes e.g. "a  1" (two spaces): the spaces must stay one token.
_DIGIT_SPLIT_PRE = frozenset({"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"})

# What the ids mean in this vocabulary, for generation_config.json and the tokenizer service.
_SPECIAL_KEYS = {
    "bos_token": "tokenizer.ggml.bos_token_id",
    "eos_token": "tokenizer.ggml.eos_token_id",
    "unk_token": "tokenizer.ggml.unknown_token_id",
    "pad_token": "tokenizer.ggml.padding_token_id",
}

# Chat models mark the end of an assistant turn with one of these; generation must stop there even
# when the file's own eos is a different token.
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<end_of_turn>", "<|end|>")


@dataclass(frozen=True)
class GGUFTokenizerData:
    """The tokenizer-relevant metadata of one GGUF file, as plain Python values."""

    architecture: str
    model_type: str
    pre_type: str | None
    tokens: list[str]
    token_types: list[int]
    merges: list[str]
    special_ids: dict[str, int]
    add_bos_token: bool
    add_eos_token: bool
    chat_template: str | None


_SCALAR_FORMATS = {
    0: "<B",
    1: "<b",
    2: "<H",
    3: "<h",
    4: "<I",
    5: "<i",
    6: "<f",
    7: "<?",
    10: "<Q",
    11: "<q",
    12: "<d",
}
_STRING = 8
_ARRAY = 9


def read_gguf_metadata(gguf_path: Path) -> dict[str, Any]:
    """All key/value metadata of a GGUF file, as Python values; tensors are never read.

    gguf's `GGUFReader` wraps each of the ~100,000 vocabulary and merge strings in its own numpy view
    (5 s for SmolLM2); walking the header with `struct` takes a fraction of that, which is what lets a
    tiny checkpoint be written in about a second even on a cold cache. Value type codes and the magic
    number are gguf's (see gguf.constants.GGUFValueType).
    """
    from gguf.constants import GGUF_MAGIC

    with open(gguf_path, "rb") as handle, mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        magic, version = struct.unpack_from("<II", buf, 0)
        if magic != GGUF_MAGIC:
            raise ValueError(f"{gguf_path} is not a GGUF file (or is big-endian, which is not supported)")
        if version < 2:
            raise ValueError(
                f"{gguf_path} is GGUF version {version}; only versions 2 and later are supported"
            )
        _tensor_count, kv_count = struct.unpack_from("<QQ", buf, 8)
        offset = 24

        def read_string(at: int) -> tuple[str, int]:
            (length,) = struct.unpack_from("<Q", buf, at)
            start = at + 8
            return buf[start : start + length].decode("utf-8", errors="replace"), start + length

        def read_value(kind: int, at: int) -> tuple[Any, int]:
            if kind == _STRING:
                return read_string(at)
            if kind == _ARRAY:
                item_kind, count = struct.unpack_from("<IQ", buf, at)
                at += 12
                if item_kind in _SCALAR_FORMATS:
                    fmt = _SCALAR_FORMATS[item_kind]
                    size = struct.calcsize(fmt)
                    values = list(struct.unpack_from(f"<{count}{fmt[1]}", buf, at)) if count else []
                    return values, at + size * count
                items = []
                for _ in range(count):
                    item, at = read_value(item_kind, at)
                    items.append(item)
                return items, at
            scalar = _SCALAR_FORMATS.get(kind)
            if scalar is None:
                raise ValueError(f"{gguf_path}: unknown GGUF value type {kind}")
            return struct.unpack_from(scalar, buf, at)[0], at + struct.calcsize(scalar)

        metadata: dict[str, Any] = {}
        for _ in range(kv_count):
            key, offset = read_string(offset)
            (kind,) = struct.unpack_from("<I", buf, offset)
            metadata[key], offset = read_value(kind, offset + 4)
    return metadata


def read_gguf_tokenizer_data(gguf_path: Path) -> GGUFTokenizerData:
    """Read vocabulary, merges, special ids and chat template from a GGUF file's metadata."""
    meta = read_gguf_metadata(gguf_path)
    model_type = meta.get("tokenizer.ggml.model")
    if model_type is None:
        raise ValueError(f"{gguf_path} has no tokenizer metadata (tokenizer.ggml.model is missing)")
    tokens = list(meta["tokenizer.ggml.tokens"])
    token_types = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    return GGUFTokenizerData(
        architecture=meta.get("general.architecture", "llama"),
        model_type=model_type,
        pre_type=meta.get("tokenizer.ggml.pre"),
        tokens=tokens,
        token_types=[int(t) for t in token_types],
        merges=list(meta.get("tokenizer.ggml.merges") or []),
        special_ids={name: int(meta[key]) for name, key in _SPECIAL_KEYS.items() if key in meta},
        add_bos_token=bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        add_eos_token=bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        chat_template=meta.get("tokenizer.chat_template"),
    )


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table that byte-level BPE vocabularies are spelled in."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    chars = printable[:]
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(printable, map(chr, chars), strict=True))


def build_sentencepiece_tokenizer(gguf_path: Path) -> Tokenizer:
    """The `tokenizers.Tokenizer` of a SentencePiece ("llama") GGUF vocabulary, as transformers'
    GGUF conversion builds it.

    Left to transformers because the details are per model and subtle: Gemma's vocabulary lists no
    merges, and they must be rebuilt in the order its tokens appear, not by their scores, and its
    runs of spaces respelled as "▁" (transformers' `gemma_tokenizer`). Reads the file's metadata
    again and takes ~20 s for Gemma 3's 262,144 tokens; done once per conversion.
    """
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    gguf_path = Path(gguf_path)
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    finally:
        hf_logging.set_verbosity(verbosity)
    return tokenizer.backend_tokenizer


def build_tokenizer(data: GGUFTokenizerData) -> Tokenizer:
    """A `tokenizers.Tokenizer` for a byte-level BPE ("gpt2") GGUF vocabulary.

    Same model, decoder, post-processor and added tokens as transformers' GGUF conversion, so its
    `tokenizer.json` is interchangeable with theirs; only the pre-tokenizer adds llama.cpp's digit
    split for vocabularies trained with it.
    """
    if data.model_type != "gpt2":
        raise ValueError(
            f"only byte-level BPE GGUF vocabularies (tokenizer.ggml.model 'gpt2') are supported, "
            f"this file has {data.model_type!r}"
        )
    spelling = bytes_to_unicode()
    alphabet = set(spelling.values())
    # Every real token is already spelled in the byte alphabet; re-spell the odd one that is not
    # (a raw-text added token), exactly as transformers does, so ids line up with theirs.
    vocab = {
        token if set(token) <= alphabet else "".join(spelling[b] for b in token.encode("utf-8")): index
        for index, token in enumerate(data.tokens)
    }
    merges = [tuple(merge.split(" ", 1)) for merge in data.merges]
    tokenizer = Tokenizer(
        models.BPE(
            vocab=vocab,
            # Each GGUF merge is "left right", so split(" ", 1) gives the pair.
            merges=merges,  # type: ignore[arg-type]
            dropout=None,
            unk_token=None,
            continuing_subword_prefix="",
            end_of_word_suffix="",
            fuse_unk=False,
            byte_fallback=False,
        )
    )
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)
    if data.pre_type in _DIGIT_SPLIT_PRE:
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level]
        )
    else:
        tokenizer.pre_tokenizer = byte_level
    # The byte-level decoder's settings are its defaults (add_prefix_space, trim_offsets and
    # use_regex all true); tokenizers' stubs accept no arguments for it.
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.TemplateProcessing(single="$A", pair="$A $B:1", special_tokens=[])
    # Control tokens (<|im_start|>, ...) must match whole in raw text, or a chat template's markers
    # would be cut into bytes. A control token outside the byte alphabet is a llama.cpp mislabel and
    # adding it would grow the vocabulary past the embedding matrix, so it is skipped.
    control = [
        AddedToken(token, normalized=False, special=True)
        for token, kind in zip(data.tokens, data.token_types, strict=True)
        if kind == _CONTROL and set(token) <= alphabet
    ]
    tokenizer.add_special_tokens(control)
    user_defined = [
        AddedToken(token, normalized=False, special=False)
        for token, kind in zip(data.tokens, data.token_types, strict=True)
        if kind == _USER_DEFINED and token in vocab
    ]
    if user_defined:
        tokenizer.add_tokens(user_defined)
    if tokenizer.get_vocab_size(with_added_tokens=True) != len(data.tokens):
        raise ValueError(
            f"rebuilt vocabulary has {tokenizer.get_vocab_size(with_added_tokens=True)} entries, "
            f"the GGUF lists {len(data.tokens)}"
        )
    return tokenizer


def special_tokens(data: GGUFTokenizerData) -> dict[str, Any]:
    """Ids and texts of bos/eos/unk/pad and the end-of-turn stop ids, for config files."""
    named = {name: data.tokens[i] for name, i in data.special_ids.items() if 0 <= i < len(data.tokens)}
    eos_ids: list[int] = []
    if "eos_token" in data.special_ids:
        eos_ids.append(data.special_ids["eos_token"])
    index = {token: i for i, token in enumerate(data.tokens)}
    for token in END_OF_TURN_TOKENS:
        if token in index and index[token] not in eos_ids:
            # The end-of-turn marker goes first: it is the stop token a chat reply ends with.
            eos_ids.insert(0, index[token])
    return {
        "ids": dict(data.special_ids),
        "tokens": named,
        "eos_token_ids": eos_ids,
        "add_bos_token": data.add_bos_token,
        "add_eos_token": data.add_eos_token,
    }


def tokenizer_config(data: GGUFTokenizerData) -> dict[str, Any]:
    """`tokenizer_config.json` content, chat template included, as transformers reads it."""
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": data.add_bos_token,
        "add_eos_token": data.add_eos_token,
        "clean_up_tokenization_spaces": False,
        # No positional limit in the tokenizer itself; the model config carries the context window.
        "model_max_length": 1_000_000_000_000_000_019_884_624_838_656,
    }
    specials = special_tokens(data)
    config.update(specials["tokens"])
    if data.chat_template:
        config["chat_template"] = data.chat_template
    return config


def default_cache_dir() -> Path:
    """Per-user cache for extracted tokenizers (XDG layout)."""
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(Path.home(), ".cache")
    return Path(root) / "cachet" / "tokenizers"


def _cache_key(gguf_path: Path) -> str:
    # Size and mtime stand in for the content: hashing 100 MB on every tiny write would cost more
    # than the write itself, and a replaced file changes at least one of them.
    stat = gguf_path.stat()
    ident = f"{gguf_path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|v1"
    return hashlib.sha256(ident.encode()).hexdigest()[:16]


def write_tokenizer_files(data: GGUFTokenizerData, out_dir: Path, gguf_path: Path | None = None) -> None:
    """Write tokenizer.json, tokenizer_config.json and special_tokens.json into `out_dir`.

    A SentencePiece ("llama") vocabulary is rebuilt from the file itself (`gguf_path`)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    if data.model_type == "llama" and gguf_path is not None:
        tokenizer = build_sentencepiece_tokenizer(gguf_path)
    else:
        tokenizer = build_tokenizer(data)
    tokenizer.save(str(out_dir / "tokenizer.json"))
    write_json(out_dir / "tokenizer_config.json", tokenizer_config(data))
    write_json(out_dir / "special_tokens.json", special_tokens(data))


def extract_tokenizer(gguf_path: Path, *, cache_dir: Path | None = None) -> Path:
    """Directory with the tokenizer files of `gguf_path`, extracted once and then served from cache."""
    gguf_path = Path(gguf_path)
    if not gguf_path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {gguf_path}")
    cache_root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    target = cache_root / _cache_key(gguf_path)
    if all((target / name).is_file() for name in TOKENIZER_FILES):
        return target
    cache_root.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=cache_root))
    try:
        write_tokenizer_files(read_gguf_tokenizer_data(gguf_path), staging, gguf_path)
        try:
            staging.rename(target)
        except OSError:
            # Another process finished the same extraction first; its copy is as good as ours.
            if not all((target / name).is_file() for name in TOKENIZER_FILES):
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def copy_tokenizer_files(source_dir: Path, out_dir: Path) -> dict[str, Any]:
    """Copy tokenizer.json and tokenizer_config.json; return the special-token description."""
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(source_dir / name, out_dir / name)
    return json.loads((source_dir / "special_tokens.json").read_text())


def special_tokens_from_hf_dir(model_dir: Path) -> dict[str, Any]:
    """The special-token description of an existing HF checkpoint (used for `vocab_from=<dir>`)."""
    tok_config = json.loads((model_dir / "tokenizer_config.json").read_text())
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    named: dict[str, str] = {}
    ids: dict[str, int] = {}
    for name in _SPECIAL_KEYS:
        value = tok_config.get(name)
        if isinstance(value, dict):
            value = value.get("content")
        if isinstance(value, str) and (token_id := tokenizer.token_to_id(value)) is not None:
            named[name] = value
            ids[name] = token_id
    eos_ids = [ids["eos_token"]] if "eos_token" in ids else []
    for token in END_OF_TURN_TOKENS:
        token_id = tokenizer.token_to_id(token)
        if token_id is not None and token_id not in eos_ids:
            eos_ids.insert(0, token_id)
    return {
        "ids": ids,
        "tokens": named,
        "eos_token_ids": eos_ids,
        "add_bos_token": bool(tok_config.get("add_bos_token", False)),
        "add_eos_token": bool(tok_config.get("add_eos_token", False)),
    }


def digit_split_pieces(text: str) -> Sequence[str]:
    """`text` cut before and after every numeric character, as the digit pre-tokenizer does.

    Exposed for tests that check our tokenizer against transformers' GGUF conversion: encoding these
    pieces one by one with theirs must give exactly our encoding of the whole text.
    """
    pieces: list[str] = []
    current = ""
    for char in text:
        # Unicode number categories, like Rust's char::is_numeric (str.isnumeric would also take "一").
        if unicodedata.category(char) in ("Nd", "Nl", "No"):
            if current:
                pieces.append(current)
                current = ""
            pieces.append(char)
        else:
            current += char
    if current:
        pieces.append(current)
    return pieces
