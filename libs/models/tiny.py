"""Tiny random-weight checkpoints for tests and CI, with the default model's real tokenizer.

A tiny model is a few MB and written in about a second, yet it is an ordinary Hugging Face directory
(config.json, model.safetensors, tokenizer.json, tokenizer_config.json with the chat template,
generation_config.json), so every service loads it through the same code path as a real model. Its
text is gibberish, but tokenization, chat templates and stop tokens are the real SmolLM2 ones.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from cachet.models._fs import atomic_directory, read_json, write_json
from cachet.models.convert_gguf import MODEL_ID_KEY, find_default_gguf, generation_config
from cachet.models.gguf_tokenizer import copy_tokenizer_files, extract_tokenizer, special_tokens_from_hf_dir

TINY_MODEL_IDS = {"llama": "tiny-llama", "kimi-k2": "tiny-kimi-k2"}

# Small enough to write and load in well under a second, large enough to exercise grouped-query
# attention (4 query heads over 2 KV heads) and more than one layer.
_LLAMA_SHAPE = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": True,
}

# Kimi K2's architecture (DeepSeek-V3: latent attention, grouped top-k MoE with shared experts) at toy
# size: the first layer dense, then MoE; 8 routed experts in 4 groups (K2 itself has 1 group, but
# more exercise the group selection), K2's sigmoid scoring, scaling factor and YaRN settings.
_KIMI_K2_SHAPE = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 3,
    "first_k_dense_replace": 1,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "q_lora_rank": 32,
    "kv_lora_rank": 32,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 16,
    "n_routed_experts": 8,
    "n_shared_experts": 2,
    "num_experts_per_tok": 2,
    "n_group": 4,
    "topk_group": 2,
    "norm_topk_prob": True,
    "routed_scaling_factor": 2.827,
    "num_nextn_predict_layers": 0,
    "max_position_embeddings": 2048,
    "rope_parameters": {
        "rope_type": "yarn",
        "rope_theta": 50000.0,
        "factor": 4.0,
        "original_max_position_embeddings": 512,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "beta_fast": 1.0,
        "beta_slow": 1.0,
    },
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    # Wider than the 0.02 default so random logits sit far apart and greedy parity is not a coin toss.
    "initializer_range": 0.1,
}
# Keys of K2's config.json that transformers' DeepseekV3Config does not keep; our engine reads them.
_KIMI_K2_EXTRA_CONFIG = {"scoring_func": "sigmoid", "topk_method": "noaux_tc", "moe_layer_freq": 1}
# Kimi K2's chat-format tokens, added to the SmolLM2 vocabulary (<|im_end|> is already there).
KIMI_K2_SPECIAL_TOKENS = (
    "<|im_system|>",
    "<|im_user|>",
    "<|im_assistant|>",
    "<|im_middle|>",
    "<|im_end|>",
    "<|tool_calls_section_begin|>",
    "<|tool_calls_section_end|>",
    "<|tool_call_begin|>",
    "<|tool_call_argument_begin|>",
    "<|tool_call_end|>",
    "<|media_start|>",
    "<|media_content|>",
    "<|media_pad|>",
    "<|media_end|>",
)
# Added as ordinary (non-special) tokens, one id each: a reasoning parser finds them in text decoded
# with skip_special_tokens=True, which would drop special tokens.
KIMI_K2_THINK_TOKENS = ("<think>", "</think>")
KIMI_K2_TEMPLATE = "kimi-k2-thinking.jinja"


def write_tiny_model(
    out_dir: Path,
    *,
    family: str = "llama",
    seed: int = 0,
    vocab_from: Path | None = None,
    overwrite: bool = False,
    tokenizer_cache_dir: Path | None = None,
) -> Path:
    """Write a tiny random-weight checkpoint of `family` to `out_dir` and return `out_dir`.

    `vocab_from` is where the tokenizer comes from: a GGUF file (its metadata is extracted once and
    cached in `tokenizer_cache_dir`), or a Hugging Face directory with tokenizer.json and
    tokenizer_config.json (for example a converted default model). Default: the SmolLM2 GGUF.
    Equal `seed`s give byte-identical weights.
    """
    if family not in TINY_MODEL_IDS:
        raise ValueError(f"unknown tiny model family {family!r}; known: {sorted(TINY_MODEL_IDS)}")
    tokenizer_dir = _tokenizer_source(vocab_from, tokenizer_cache_dir)
    out_dir = Path(out_dir)
    with atomic_directory(out_dir, overwrite=overwrite) as staging:
        specials = copy_tokenizer_files(tokenizer_dir, staging)
        if family == "kimi-k2":
            _add_kimi_k2_tokens(staging)
        vocab_size = _vocab_size(staging / "tokenizer.json")
        writer = _write_kimi_k2 if family == "kimi-k2" else _write_llama
        writer(staging, vocab_size=vocab_size, seed=seed, specials=specials, model_id=TINY_MODEL_IDS[family])
    return out_dir


def kimi_k2_chat_template() -> str:
    """Kimi K2 Thinking's chat template, shipped as package data."""
    from importlib.resources import files

    return (files("cachet.models") / "templates" / KIMI_K2_TEMPLATE).read_text(encoding="utf-8")


def _add_kimi_k2_tokens(out_dir: Path) -> None:
    """Append K2's chat tokens to tokenizer.json and put K2's template in tokenizer_config.json."""
    from tokenizers import AddedToken, Tokenizer

    tokenizer = Tokenizer.from_file(str(out_dir / "tokenizer.json"))
    # add_* skips tokens already present, so <|im_end|> keeps SmolLM2's id (its end-of-turn stop).
    tokenizer.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t in KIMI_K2_SPECIAL_TOKENS]
    )
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in KIMI_K2_THINK_TOKENS])
    tokenizer.save(str(out_dir / "tokenizer.json"))
    config = read_json(out_dir / "tokenizer_config.json")
    config["chat_template"] = kimi_k2_chat_template()
    config["eos_token"] = "<|im_end|>"
    write_json(out_dir / "tokenizer_config.json", config)


def _tokenizer_source(vocab_from: Path | None, cache_dir: Path | None) -> Path:
    source = Path(vocab_from) if vocab_from is not None else find_default_gguf()
    if source.is_file():
        return extract_tokenizer(source, cache_dir=cache_dir)
    if source.is_dir():
        missing = [n for n in ("tokenizer.json", "tokenizer_config.json") if not (source / n).is_file()]
        if missing:
            raise FileNotFoundError(f"vocab_from={source} lacks {', '.join(missing)}")
        if not (source / "special_tokens.json").is_file():
            # A full checkpoint rather than our extraction cache: derive the description, but write
            # it into a scratch copy, never into the user's model directory.
            return _describe_hf_dir(source, cache_dir)
        return source
    raise FileNotFoundError(f"vocab_from={source} is neither a GGUF file nor a directory")


def _describe_hf_dir(source: Path, cache_dir: Path | None) -> Path:
    import hashlib
    import shutil

    from cachet.models.gguf_tokenizer import default_cache_dir

    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    digest = hashlib.sha256((source / "tokenizer.json").read_bytes())
    digest.update((source / "tokenizer_config.json").read_bytes())
    target = root / f"hf-{digest.hexdigest()[:16]}"
    if not (target / "special_tokens.json").is_file():
        with atomic_directory(target, overwrite=target.exists()) as staging:
            for name in ("tokenizer.json", "tokenizer_config.json"):
                shutil.copyfile(source / name, staging / name)
            write_json(staging / "special_tokens.json", special_tokens_from_hf_dir(source))
    return target


def _vocab_size(tokenizer_json: Path) -> int:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(tokenizer_json)).get_vocab_size(with_added_tokens=True)


def _write_llama(out_dir: Path, *, vocab_size: int, seed: int, specials: dict, model_id: str) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    _write_random_model(
        out_dir, LlamaConfig, LlamaForCausalLM, _LLAMA_SHAPE,
        vocab_size=vocab_size, seed=seed, specials=specials, model_id=model_id,
    )  # fmt: skip


def _write_kimi_k2(out_dir: Path, *, vocab_size: int, seed: int, specials: dict, model_id: str) -> None:
    import torch
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    def steer_routing(model: DeepseekV3ForCausalLM) -> None:
        # transformers starts the routing bias at zero; random values make it steer routing.
        with torch.no_grad():
            for layer in model.model.layers[model.config.first_k_dense_replace :]:
                layer.mlp.gate.e_score_correction_bias.normal_(0, 0.1)

    # model_type deepseek_v3 (K2's own config says kimi_k2 and needs remote code): transformers
    # loads it natively, which is what the parity tests compare against.
    _write_random_model(
        out_dir, DeepseekV3Config, DeepseekV3ForCausalLM, _KIMI_K2_SHAPE,
        vocab_size=vocab_size, seed=seed, specials=specials, model_id=model_id,
        initialise=steer_routing, extra_config=_KIMI_K2_EXTRA_CONFIG,
    )  # fmt: skip


def _write_random_model(
    out_dir: Path,
    config_class: type,
    model_class: type,
    shape: dict,
    *,
    vocab_size: int,
    seed: int,
    specials: dict,
    model_id: str,
    initialise: Callable[[Any], None] | None = None,
    extra_config: dict | None = None,
) -> None:
    import torch

    ids = specials["ids"]
    eos_ids: list[int] = specials["eos_token_ids"]
    config = config_class(
        vocab_size=vocab_size,
        bos_token_id=ids.get("bos_token"),
        eos_token_id=eos_ids[0] if len(eos_ids) == 1 else eos_ids,
        pad_token_id=ids.get("pad_token"),
        **shape,
    )
    # A private RNG stream: the caller's global torch seed stays as it was, and equal seeds give equal
    # weights whatever ran before.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_class(config)
        if initialise is not None:
            initialise(model)
    model.save_pretrained(str(out_dir), safe_serialization=True)

    saved = read_json(out_dir / "config.json")
    saved.update(extra_config or {})
    saved[MODEL_ID_KEY] = model_id
    write_json(out_dir / "config.json", saved)
    write_json(out_dir / "generation_config.json", generation_config(ids, eos_ids, saved))
