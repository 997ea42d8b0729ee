"""What the router needs to know about a model, read from its checkpoint directory.

- Context window: ``max_position_embeddings`` from config.json (or its
  ``text_config`` for multimodal checkpoints), else the tokenizer's
  ``model_max_length`` when that is a real number rather than transformers'
  "no limit" sentinel (1e30).
- Stop token ids: the end-of-sequence ids of generation_config.json and
  config.json, the tokenizer's eos, and the end-of-turn tokens chat templates
  write (``<|im_end|>``, ``<|eot_id|>``...) when the vocabulary has them as
  special tokens. A chat model whose eos is ``<|endoftext|>`` still ends its
  turn with ``<|im_end|>``; without it generation would run on into a new turn.
- Vision: a ``kimi_k25``-style config.json (``vision_config`` with ``patch_size`` and
  ``merge_kernel_size``, and ``media_placeholder_token_id`` at its top level) makes a model
  accept images (``VisionInfo``); the patch budget comes from preprocessor_config.json when the
  checkpoint ships one. A model without a vision config refuses image parts.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from transformers import PreTrainedTokenizerBase

# Chat templates close an assistant turn with one of these.
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<end_of_turn>", "<|end|>", "<|endoftext|>")

# model_max_length above this is a placeholder, not a limit (transformers uses 1e30).
_SANE_MAX_LENGTH = 10_000_000

_CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length")

# Kimi K2.5's image processor: at most this many patches per image, and per side.
DEFAULT_MAX_PATCHES = 16384
DEFAULT_MAX_PATCHES_PER_SIDE = 512
# Where an image sits in a Kimi prompt: its placeholder wrapped in the media markers. K2.5's
# vocabulary spells the opening marker <|media_begin|>, K2's chat template <|media_start|>.
_MEDIA_BEGIN = ("<|media_begin|>", "<|media_start|>")
_MEDIA_CONTENT = "<|media_content|>"
_MEDIA_END = "<|media_end|>"


@dataclass(frozen=True)
class SpecialToken:
    text: str
    token_id: int


@dataclass(frozen=True)
class VisionInfo:
    """How a model with a vision encoder takes images: its patch grid and its placeholder."""

    # The one token an image part renders to, which the tokenizer service then repeats once
    # per merged patch (docs/ARCHITECTURE.md, "Images").
    placeholder_token_id: int
    # The text an image part becomes in a message's content: the placeholder inside the
    # model's media markers, e.g. <|media_begin|>image<|media_content|><|media_pad|><|media_end|>.
    placeholder_text: str
    patch_size: int
    # Patches merged into one token, (rows, columns).
    merge_kernel: tuple[int, int]
    max_patches: int
    max_patches_per_side: int


@dataclass(frozen=True)
class ModelInfo:
    """A loaded model's identity and limits; immutable once loaded."""

    model_id: str
    context_window: int
    vocab_size: int
    stop_token_ids: tuple[int, ...]
    special_tokens: tuple[SpecialToken, ...]
    template_supports_tools: bool
    bos_token_id: int | None
    # None: no vision encoder, image parts are refused.
    vision: VisionInfo | None = None
    # Added tokens that are not special (decoded as text): a reasoning model's <think> markers.
    added_tokens: tuple[SpecialToken, ...] = ()


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    with open(path, encoding="utf-8") as handle:
        value = json.load(handle)
    return value if isinstance(value, dict) else {}


def _as_id_list(value: Any) -> list[int]:
    if isinstance(value, int) and not isinstance(value, bool):
        return [value]
    if isinstance(value, list):
        return [item for item in value if isinstance(item, int) and not isinstance(item, bool)]
    return []


def context_window(config: dict[str, Any], tokenizer: PreTrainedTokenizerBase) -> int:
    """Longest prompt plus completion the model was built for."""
    for section in (config, config.get("text_config") or {}):
        for key in _CONTEXT_KEYS:
            value = section.get(key)
            if isinstance(value, int) and value > 0:
                return value
    max_length = getattr(tokenizer, "model_max_length", None)
    if isinstance(max_length, int) and 0 < max_length <= _SANE_MAX_LENGTH:
        return max_length
    raise ValueError(
        "cannot tell the model's context window: config.json has no max_position_embeddings "
        "and the tokenizer's model_max_length is unset"
    )


def special_tokens(tokenizer: PreTrainedTokenizerBase) -> tuple[SpecialToken, ...]:
    """Every special token of the vocabulary, by id."""
    found = {
        token_id: added.content for token_id, added in tokenizer.added_tokens_decoder.items() if added.special
    }
    for text in tokenizer.all_special_tokens:
        token_id = tokenizer.convert_tokens_to_ids(text)
        # An unknown text maps to the unk id: keep only tokens that really are in the vocabulary.
        if isinstance(token_id, int) and tokenizer.convert_ids_to_tokens(token_id) == text:
            found.setdefault(token_id, text)
    return tuple(SpecialToken(text=text, token_id=token_id) for token_id, text in sorted(found.items()))


def added_text_tokens(tokenizer: PreTrainedTokenizerBase) -> tuple[SpecialToken, ...]:
    """Tokens added to the vocabulary but not special, by id."""
    return tuple(
        SpecialToken(text=added.content, token_id=token_id)
        for token_id, added in sorted(tokenizer.added_tokens_decoder.items())
        if not added.special
    )


def stop_token_ids(
    config: dict[str, Any],
    generation_config: dict[str, Any],
    tokenizer: PreTrainedTokenizerBase,
    specials: tuple[SpecialToken, ...],
) -> tuple[int, ...]:
    """End-of-sequence and end-of-turn ids, without duplicates, in a stable order."""
    ids = [
        *_as_id_list(generation_config.get("eos_token_id")),
        *_as_id_list(config.get("eos_token_id")),
        *_as_id_list(tokenizer.eos_token_id),
    ]
    by_text = {special.text: special.token_id for special in specials}
    ids.extend(by_text[text] for text in END_OF_TURN_TOKENS if text in by_text)
    return tuple(dict.fromkeys(ids))


def bos_token_id(
    config: dict[str, Any], generation_config: dict[str, Any], tokenizer: PreTrainedTokenizerBase
) -> int | None:
    for candidate in (
        tokenizer.bos_token_id,
        generation_config.get("bos_token_id"),
        config.get("bos_token_id"),
    ):
        if isinstance(candidate, int) and not isinstance(candidate, bool):
            return candidate
    return None


def _positive_int(value: Any) -> int | None:
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    return None


def _merge_kernel(value: Any) -> tuple[int, int]:
    if _positive_int(value):
        return (value, value)
    if isinstance(value, list | tuple) and len(value) == 2 and all(map(_positive_int, value)):
        return (value[0], value[1])
    raise ValueError(
        f"config.json: vision_config.merge_kernel_size {value!r} is not a size or a pair of sizes"
    )


def _patch_budget(preprocessor: dict[str, Any]) -> tuple[int, int]:
    """(max patches, max patches per side): transformers' image processor keys, else the
    ``media_proc_cfg`` of Moonshot's own processor, else K2.5's defaults."""
    moonshot = preprocessor.get("media_proc_cfg") or {}
    size = preprocessor.get("size") or {}
    max_patches = _positive_int(preprocessor.get("max_patches")) or _positive_int(
        moonshot.get("in_patch_limit")
    )
    per_side = _positive_int(size.get("max_height")) or _positive_int(moonshot.get("patch_limit_on_one_side"))
    return max_patches or DEFAULT_MAX_PATCHES, per_side or DEFAULT_MAX_PATCHES_PER_SIDE


def vision_info(
    config: dict[str, Any], preprocessor: dict[str, Any], specials: tuple[SpecialToken, ...]
) -> VisionInfo | None:
    """The model's image input, or None when config.json has no ``vision_config``."""
    vision = config.get("vision_config")
    if not isinstance(vision, dict):
        return None
    # Moonshot's config names it media_placeholder_token_id; transformers' image_token_id.
    token_id = _positive_int(config.get("media_placeholder_token_id")) or _positive_int(
        config.get("image_token_id")
    )
    if token_id is None:
        raise ValueError("config.json has a vision_config but no media_placeholder_token_id")
    by_id = {special.token_id: special.text for special in specials}
    by_text = {special.text: special.token_id for special in specials}
    if token_id not in by_id:
        raise ValueError(
            f"config.json: media_placeholder_token_id {token_id} is not a special token of the vocabulary"
        )
    pad = by_id[token_id]
    begin = next((text for text in _MEDIA_BEGIN if text in by_text), None)
    if begin is not None and _MEDIA_CONTENT in by_text and _MEDIA_END in by_text:
        text = f"{begin}image{_MEDIA_CONTENT}{pad}{_MEDIA_END}"
    else:
        text = pad
    patch_size = _positive_int(vision.get("patch_size", 14))
    if patch_size is None:
        raise ValueError(f"config.json: vision_config.patch_size {vision.get('patch_size')!r} is not a size")
    max_patches, per_side = _patch_budget(preprocessor)
    return VisionInfo(
        placeholder_token_id=token_id,
        placeholder_text=text,
        patch_size=patch_size,
        merge_kernel=_merge_kernel(vision.get("merge_kernel_size", 2)),
        max_patches=max_patches,
        max_patches_per_side=per_side,
    )


def read_model_info(
    model_id: str, path: Path, tokenizer: PreTrainedTokenizerBase, *, template_supports_tools: bool
) -> ModelInfo:
    """Collect a model's metadata from its directory and its loaded tokenizer."""
    config = _read_json(path / "config.json")
    generation_config = _read_json(path / "generation_config.json")
    specials = special_tokens(tokenizer)
    return ModelInfo(
        model_id=model_id,
        context_window=context_window(config, tokenizer),
        vocab_size=len(tokenizer),
        stop_token_ids=stop_token_ids(config, generation_config, tokenizer, specials),
        special_tokens=specials,
        template_supports_tools=template_supports_tools,
        bos_token_id=bos_token_id(config, generation_config, tokenizer),
        vision=vision_info(config, _read_json(path / "preprocessor_config.json"), specials),
        added_tokens=added_text_tokens(tokenizer),
    )
