"""Tiny random-weight checkpoints for tests and CI, with the default model's real tokenizer.

A tiny model is a few MB and written in about a second, yet it is an ordinary Hugging Face directory
(config.json, model.safetensors, tokenizer.json, tokenizer_config.json with the chat template,
generation_config.json), so every service loads it through the same code path as a real model. Its
text is gibberish, but tokenization, chat templates and stop tokens are the real SmolLM2 ones.
The tiny Kimi K2.5 ships its tokenizer as Moonshot does instead: a tiktoken rank file derived from
SmolLM2's vocabulary, Kimi's added tokens and K2.5's chat template (``kimi_tiktoken``).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from cachet.models._fs import atomic_directory, read_json, write_json
from cachet.models.convert_gguf import MODEL_ID_KEY, find_default_gguf, generation_config
from cachet.models.gguf_tokenizer import copy_tokenizer_files, extract_tokenizer, special_tokens_from_hf_dir
from cachet.models.kimi_tiktoken import (
    NUM_RESERVED_IDS,
    added_token_ids,
    ranks_from_byte_level_bpe,
    write_kimi_tokenizer,
)

TINY_MODEL_IDS = {
    "llama": "tiny-llama",
    "kimi-k2": "tiny-kimi-k2",
    "kimi-k2.5": "tiny-kimi-k2.5",
    "gemma3": "tiny-gemma3",
}

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

# Gemma 3's text model at toy size, every one of its differences from Llama made to matter: a
# window of 8 keys (prompts of tests run past it), local layers around a global one, each kind with
# its own RoPE base, a head_dim (32) that is not hidden / heads (16), a query_pre_attn_scalar (24)
# that is not head_dim, and soft-capped logits.
_GEMMA3_SHAPE = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "query_pre_attn_scalar": 24,
    "sliding_window": 8,
    "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
    "rope_parameters": {
        "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
        "full_attention": {"rope_type": "default", "rope_theta": 10000.0},
    },
    "final_logit_softcapping": 30.0,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
    # Wider than the 0.02 default so random logits sit far apart and greedy parity is not a coin toss.
    "initializer_range": 0.1,
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

# Kimi K2.5 as Moonshot publishes it, in miniature: a kimi_k25 wrapper around the tiny K2 language
# model (its tensors under ``language_model.``, routed experts INT4 as compressed-tensors
# ``pack-quantized``), MoonViT and its projector beside it (bf16, as published), its tiktoken
# tokenizer and chat template (``kimi_tiktoken``), and the image tokens K2.5's processor writes:
# <|media_begin|>image<|media_content|><|media_pad|>...<|media_end|>, one <|media_pad|> per merged
# 2x2 block of 14-pixel patches.
KIMI_K25_IMAGE_TOKEN = "<|media_pad|>"
# The published vision_config's keys, at toy size: 32 wide (2 heads of 16: 2-D RoPE wants a head
# width divisible by 4), 2 blocks, an 8x8 position table (resampled to each image's grid).
_KIMI_K25_VISION = {
    "model_type": "",
    "patch_size": 14,
    "init_pos_emb_height": 8,
    "init_pos_emb_width": 8,
    "init_pos_emb_time": 4,
    "pos_emb_type": "divided_fixed",
    "merge_kernel_size": [2, 2],
    "merge_type": "sd2_tpool",
    "video_attn_type": "spatial_temporal",
    "vt_hidden_size": 32,
    "vt_intermediate_size": 64,
    "vt_num_hidden_layers": 2,
    "vt_num_attention_heads": 2,
    "mm_hidden_size": 32,
    "mm_projector_type": "patchmerger",
    "projector_hidden_act": "gelu",
    "projector_ln_eps": 1e-05,
}
# K2.5's published quantization_config: symmetric INT4 in groups of 32, everything but the routed
# experts left alone.
KIMI_K25_QUANTIZATION: dict[str, Any] = {
    "config_groups": {
        "group_0": {
            "input_activations": None,
            "output_activations": None,
            "targets": ["Linear"],
            "weights": {
                "actorder": None,
                "block_structure": None,
                "dynamic": False,
                "group_size": 32,
                "num_bits": 4,
                "observer": "minmax",
                "observer_kwargs": {},
                "strategy": "group",
                "symmetric": True,
                "type": "int",
            },
        }
    },
    "format": "pack-quantized",
    "ignore": [
        "lm_head",
        "re:.*self_attn.*",
        "re:.*shared_experts.*",
        r"re:.*mlp\.(gate|up|gate_up|down)_proj.*",
    ],
    "kv_cache_scheme": None,
    "quant_method": "compressed-tensors",
    "quantization_status": "compressed",
}
_INT4_GROUP = 32


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
        specials, vocab_size = _write_tokenizer(family, tokenizer_dir, staging)
        writers = {"kimi-k2": _write_kimi_k2, "kimi-k2.5": _write_kimi_k25, "gemma3": _write_gemma3}
        writer = writers.get(family, _write_llama)
        writer(staging, vocab_size=vocab_size, seed=seed, specials=specials, model_id=TINY_MODEL_IDS[family])
    return out_dir


def kimi_k2_chat_template() -> str:
    """Kimi K2 Thinking's chat template, shipped as package data."""
    from importlib.resources import files

    return (files("cachet.models") / "templates" / KIMI_K2_TEMPLATE).read_text(encoding="utf-8")


def _write_tokenizer(family: str, tokenizer_dir: Path, out_dir: Path) -> tuple[dict, int]:
    """The family's tokenizer files in ``out_dir``, from the source in ``tokenizer_dir``; the
    special-token description and the vocabulary size (added tokens included)."""
    if family == "kimi-k2.5":
        ranks = ranks_from_byte_level_bpe(tokenizer_dir / "tokenizer.json")
        return write_kimi_tokenizer(out_dir, ranks), len(ranks) + NUM_RESERVED_IDS
    specials = copy_tokenizer_files(tokenizer_dir, out_dir)
    if family == "kimi-k2":
        _add_kimi_k2_tokens(out_dir)
    return specials, _vocab_size(out_dir / "tokenizer.json")


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


def _write_gemma3(out_dir: Path, *, vocab_size: int, seed: int, specials: dict, model_id: str) -> None:
    import torch
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    def offset_norms(model: Gemma3ForCausalLM) -> None:
        # transformers starts Gemma's norm weights (offsets from one) at zero; random ones make
        # a mix-up of the two conventions show.
        with torch.no_grad():
            for name, parameter in model.named_parameters():
                if name.endswith("norm.weight"):
                    parameter.normal_(0, 0.2)

    _write_random_model(
        out_dir, Gemma3TextConfig, Gemma3ForCausalLM, _GEMMA3_SHAPE,
        vocab_size=vocab_size, seed=seed, specials=specials, model_id=model_id, initialise=offset_norms,
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


def _write_kimi_k25(out_dir: Path, *, vocab_size: int, seed: int, specials: dict, model_id: str) -> None:
    """The tiny K2 language model, rewritten into K2.5's published layout beside a tiny MoonViT."""
    import torch
    from safetensors.torch import load_file, save_file

    _write_kimi_k2(out_dir, vocab_size=vocab_size, seed=seed, specials=specials, model_id=model_id)
    text_config = read_json(out_dir / "config.json")
    text_config.pop(MODEL_ID_KEY)
    text_config["model_type"] = "deepseek_v3"
    text_config["quantization_config"] = KIMI_K25_QUANTIZATION
    stored = {}
    for name, tensor in load_file(str(out_dir / "model.safetensors")).items():
        if ".mlp.experts." in name and name.endswith("_proj.weight"):
            base = "language_model." + name.removesuffix("weight")
            stored.update({base + role: part for role, part in pack_int4(tensor, _INT4_GROUP).items()})
        else:
            stored["language_model." + name] = tensor
    vision = {**_KIMI_K25_VISION, "text_hidden_size": text_config["hidden_size"]}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed + 1)
        stored.update(kimi_vision_tensors(vision))
    save_file(stored, str(out_dir / "model.safetensors"), metadata={"format": "pt"})

    image_token_id = added_token_ids(vocab_size - NUM_RESERVED_IDS)[KIMI_K25_IMAGE_TOKEN]
    write_json(
        out_dir / "config.json",
        {
            "architectures": ["KimiK25ForConditionalGeneration"],
            "model_type": "kimi_k25",
            "bos_token_id": text_config.get("bos_token_id"),
            "eos_token_id": text_config.get("eos_token_id"),
            "pad_token_id": text_config.get("pad_token_id"),
            "media_placeholder_token_id": image_token_id,
            "tie_word_embeddings": False,
            "quantization_config": KIMI_K25_QUANTIZATION,
            "text_config": text_config,
            "vision_config": vision,
            MODEL_ID_KEY: model_id,
        },
    )


def pack_int4(weight: Any, group: int) -> dict[str, Any]:
    """compressed-tensors ``pack-quantized`` INT4: symmetric, one bf16 scale per ``group`` inputs of a
    row, values offset by 8 and packed eight to an int32 word, the first in the lowest bits."""
    import torch

    rows, columns = weight.shape
    groups = weight.float().view(rows, columns // group, group)
    scale = (groups.abs().amax(dim=-1) / 7).clamp(min=1e-8).to(torch.bfloat16)
    values = (groups / scale.float()[..., None]).round().clamp(-8, 7).to(torch.int64).view(rows, columns)
    nibbles = (values + 8).view(rows, columns // 8, 8)
    words = (nibbles << (4 * torch.arange(8))).sum(dim=-1)
    words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)  # two's complement
    return {
        "weight_packed": words.contiguous(),
        "weight_scale": scale.contiguous(),
        "weight_shape": torch.tensor([rows, columns], dtype=torch.int32),
    }


def kimi_vision_tensors(vision: dict) -> dict[str, Any]:
    """Random MoonViT + projector tensors (bf16) under K2.5's published names, from a published-style
    ``vision_config``; drawn from torch's global generator (the caller seeds it)."""
    import torch

    d, inner, p = vision["vt_hidden_size"], vision["vt_intermediate_size"], vision["patch_size"]
    merged = d * vision["merge_kernel_size"][0] * vision["merge_kernel_size"][1]
    text = vision["text_hidden_size"]
    # name -> (shape, kind): "gain" near one (LayerNorm weights), "small" (biases, positions), or a
    # linear's weight (scaled by its fan-in, so activations keep their size through the blocks).
    shapes: dict[str, tuple[tuple[int, ...], str]] = {
        "vision_tower.patch_embed.proj.weight": ((d, 3, p, p), "linear"),
        "vision_tower.patch_embed.proj.bias": ((d,), "small"),
        "vision_tower.patch_embed.pos_emb.weight": (
            (vision["init_pos_emb_height"], vision["init_pos_emb_width"], d),
            "small",
        ),
    }
    for i in range(vision["vt_num_hidden_layers"]):
        block = f"vision_tower.encoder.blocks.{i}."
        for norm in ("norm0", "norm1"):
            shapes[block + norm + ".weight"] = ((d,), "gain")
            shapes[block + norm + ".bias"] = ((d,), "small")
        for name, out, fan_in in (
            ("wqkv", 3 * d, d),
            ("wo", d, d),
            ("mlp.fc0", inner, d),
            ("mlp.fc1", d, inner),
        ):
            shapes[block + name + ".weight"] = ((out, fan_in), "linear")
            shapes[block + name + ".bias"] = ((out,), "small")
    shapes |= {
        "vision_tower.encoder.final_layernorm.weight": ((d,), "gain"),
        "vision_tower.encoder.final_layernorm.bias": ((d,), "small"),
        "mm_projector.pre_norm.weight": ((d,), "gain"),
        "mm_projector.pre_norm.bias": ((d,), "small"),
        "mm_projector.proj.0.weight": ((merged, merged), "linear"),
        "mm_projector.proj.0.bias": ((merged,), "small"),
        "mm_projector.proj.2.weight": ((text, merged), "linear"),
        "mm_projector.proj.2.bias": ((text,), "small"),
    }
    tensors = {}
    for name, (shape, kind) in shapes.items():
        values = torch.randn(shape)
        if kind == "gain":
            values = 1 + 0.1 * values
        elif kind == "small":
            values = 0.1 * values
        else:
            values = values / (values[0].numel() ** 0.5)
        tensors[name] = values.to(torch.bfloat16)
    return tensors


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
