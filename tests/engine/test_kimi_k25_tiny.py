"""The tiny Kimi K2.5 checkpoint (``cachet model tiny --family kimi-k2.5``) in the engine, and against
transformers' Kimi_K25ForConditionalGeneration loaded from the same directory.

The checkpoint is the released layout in miniature: a kimi_k25 wrapper config, the language model
under ``language_model.`` with INT4 (compressed-tensors) routed experts, MoonViT and its projector
beside it. transformers reads those names through its own conversion mapping for kimi_k25; it
cannot read compressed-tensors without that package (not a Cachet dependency), so its copy of the
checkpoint has the experts dequantized here, by this file's own unpacker. In fp32 the engine's
dequantize-on-load gives the same values, so logits agree to fp32 rounding.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from deepseek_ep_worker import batched_greedy, prefill_logits, prompt, runner_for
from safetensors.torch import load_file, save_file

from cachet.engine.attention import SequenceSpan, build_attention_metadata
from cachet.engine.checkpoint_names import group_checkpoint_names
from cachet.engine.image_embeddings import ImageEmbeddings
from cachet.engine.loop_builder import model_tokenizer
from cachet.engine.model_runner import ModelRunner
from cachet.engine.models import ModelConfig
from cachet.engine.models.config import PackedIntQuantization
from cachet.engine.models.kimi_vision import KimiVisionTower, normalized_patches
from cachet.engine.structured_output import GrammarCompiler, GrammarSpec
from cachet.models.tiny import KIMI_K25_IMAGE_TOKEN, TINY_MODEL_IDS, write_tiny_model

PATCH = 14


@pytest.fixture(scope="module")
def k25_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("tiny-k25")
    return write_tiny_model(root / "k25", family="kimi-k2.5", tokenizer_cache_dir=root / "tok-cache")


@pytest.fixture(scope="module")
def dequantized_dir(k25_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same checkpoint with every INT4 expert stored as its fp32 values (for transformers)."""
    target = tmp_path_factory.mktemp("tiny-k25-dequantized") / "k25"
    shutil.copytree(k25_dir, target)
    stored = load_file(str(k25_dir / "model.safetensors"))
    plain = {}
    for name, tensor in stored.items():
        if name.endswith("weight_packed"):
            base = name.removesuffix("weight_packed")
            plain[base + "weight"] = _unpack_int4(
                tensor, stored[base + "weight_scale"], stored[base + "weight_shape"]
            )
        elif not name.endswith(("weight_scale", "weight_shape")):
            plain[name] = tensor
    save_file(plain, str(target / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((target / "config.json").read_text())
    del config["quantization_config"], config["text_config"]["quantization_config"]
    (target / "config.json").write_text(json.dumps(config))
    return target


def _unpack_int4(words: torch.Tensor, scale: torch.Tensor, shape: torch.Tensor) -> torch.Tensor:
    """Eight 4-bit values a word, lowest bits first, each offset by 8; times its group's scale."""
    rows, columns = shape.tolist()
    unsigned = words.to(torch.int64) & 0xFFFFFFFF
    values = torch.stack([(unsigned >> (4 * i)) & 0xF for i in range(8)], dim=-1).view(rows, columns) - 8
    group = columns // scale.shape[1]
    return values.float() * scale.float().repeat_interleave(group, dim=1)


@pytest.fixture(scope="module")
def reference(dequantized_dir: Path):
    """transformers' Kimi K2.5 in fp32, from the published-layout names of the same checkpoint."""
    modeling = pytest.importorskip("transformers.models.kimi_k25.modeling_kimi_k25")
    from transformers.models.kimi_k25.configuration_kimi_k25 import Kimi_K25Config

    raw = json.loads((dequantized_dir / "config.json").read_text())
    vision = raw["vision_config"]
    # The published config.json spells MoonViT's settings its own way (vt_*, init_pos_emb_*);
    # transformers' config class takes them under its names.
    config = Kimi_K25Config(
        text_config=raw["text_config"],
        vision_config={
            "patch_size": vision["patch_size"],
            "hidden_size": vision["vt_hidden_size"],
            "intermediate_size": vision["vt_intermediate_size"],
            "num_hidden_layers": vision["vt_num_hidden_layers"],
            "num_attention_heads": vision["vt_num_attention_heads"],
            "pos_emb_height": vision["init_pos_emb_height"],
            "pos_emb_width": vision["init_pos_emb_width"],
            "pos_emb_time": vision["init_pos_emb_time"],
            "merge_kernel_size": vision["merge_kernel_size"],
        },
        projection_hidden_size=vision["vt_hidden_size"],
        projection_layer_norm_eps=vision["projector_ln_eps"],
        image_token_id=raw["media_placeholder_token_id"],
        tie_word_embeddings=raw["tie_word_embeddings"],
    )
    model, info = modeling.Kimi_K25ForConditionalGeneration.from_pretrained(
        str(dequantized_dir), config=config, dtype=torch.float32, output_loading_info=True
    )
    assert (info["missing_keys"], info["unexpected_keys"], info["mismatched_keys"]) == (set(), set(), set())
    return model.eval()


def test_the_checkpoint_is_k25s_released_layout_in_miniature(k25_dir: Path) -> None:
    raw = json.loads((k25_dir / "config.json").read_text())
    assert raw["model_type"] == "kimi_k25" and raw["cachet_model_id"] == TINY_MODEL_IDS["kimi-k2.5"]
    config = ModelConfig.from_dict(raw)
    assert config.checkpoint_prefix == "language_model."
    assert config.quantization == PackedIntQuantization(
        num_bits=4, group_size=32, ignore=tuple(raw["quantization_config"]["ignore"])
    )
    vision = config.vision
    assert vision is not None and vision.text_hidden_size == config.hidden_size
    assert (vision.hidden_size, vision.num_hidden_layers, vision.pos_emb_grid) == (32, 2, (8, 8, 4))
    # Kimi's tokenizer files: a tiktoken rank file, its added tokens, the chat template.
    assert {"tiktoken.model", "tokenizer_config.json", "chat_template.jinja"} <= {
        p.name for p in k25_dir.iterdir()
    }
    assert not (k25_dir / "tokenizer.json").exists()
    tokenizer = model_tokenizer(k25_dir)
    assert tokenizer is not None
    assert config.vocab_size == tokenizer.get_vocab_size(with_added_tokens=True)
    assert vision.media_placeholder_token_id == tokenizer.token_to_id(KIMI_K25_IMAGE_TOKEN)
    specials = {t.content for t in tokenizer.get_added_tokens_decoder().values() if t.special}
    assert {"<|media_begin|>", "<|media_content|>", "<|media_pad|>", "<|media_end|>"} <= specials
    stored = load_file(str(k25_dir / "model.safetensors"))
    names = group_checkpoint_names(stored, config)
    assert names.unexpected == [] and len(names.vision) == 2 * 12 + 5 + 6
    assert stored["language_model.model.layers.1.mlp.experts.3.up_proj.weight_packed"].dtype == torch.int32
    assert all(stored[n].dtype == torch.bfloat16 for n in names.vision)
    assert not any(".experts." in n and n.endswith(".weight") for n in stored)


def test_the_engine_reads_its_tiktoken_tokenizer_for_stop_strings_and_grammars(k25_dir: Path) -> None:
    """The engine rebuilds the rank file as the tokenizer service does: the same ids."""
    from cachet.tokenizer.tokenizer_model import TokenizerModel

    tokenizer = model_tokenizer(k25_dir)
    assert tokenizer is not None
    service = TokenizerModel.load(TINY_MODEL_IDS["kimi-k2.5"], k25_dir)
    text = "<|im_user|>user<|im_middle|>Describe the picture, then stop.<|im_end|>"
    assert tokenizer.encode(text, add_special_tokens=False).ids == service.encode(
        text, add_special_tokens=False
    )
    im_end = tokenizer.token_to_id("<|im_end|>")
    compiler = GrammarCompiler(tokenizer, ModelConfig.from_model_dir(k25_dir).vocab_size, (im_end,))
    try:
        matcher = compiler.new_matcher(GrammarSpec("regex", "(yes|no) 图片")).result(timeout=60)
    finally:
        compiler.shutdown()
    assert matcher.consume_tokens(service.encode("yes 图片", add_special_tokens=False))
    assert matcher.consume_token(im_end) and matcher.is_stopped()


def test_the_runner_loads_it_and_generates_text_greedily(k25_dir: Path) -> None:
    runner = runner_for(k25_dir)
    assert isinstance(runner.model.vision_tower, KimiVisionTower)
    prompts = {"a": prompt(1, 13), "b": prompt(2, 30)}
    tokens = batched_greedy(runner, prompts, 6)
    assert {rid: len(t) for rid, t in tokens.items()} == {"a": 6, "b": 6}
    assert batched_greedy(runner_for(k25_dir), prompts, 6) == tokens


def test_bf16_on_cpu_serves_it_with_the_tower_in_bf16(k25_dir: Path) -> None:
    runner = ModelRunner(
        k25_dir, dtype=torch.bfloat16, device=torch.device("cpu"), kv_cache_bytes=1 << 20, block_size=4
    )
    tower = runner.model.vision_tower
    assert tower is not None and tower.patch_embed.proj.weight.dtype == torch.bfloat16
    pixels = torch.randint(
        0, 256, (4 * PATCH, 6 * PATCH, 3), dtype=torch.uint8, generator=torch.Generator().manual_seed(0)
    )
    with torch.inference_mode():
        rows = tower.encode_image(normalized_patches(pixels, PATCH), 4, 6)
    assert rows.shape == (6, runner.config.hidden_size) and rows.dtype == torch.bfloat16
    assert len(batched_greedy(runner, {"a": prompt(3, 9)}, 3)["a"]) == 3


def test_text_logits_match_transformers(k25_dir: Path, reference) -> None:
    ids = prompt(5, 40)
    ours = prefill_logits(runner_for(k25_dir), ids)
    with torch.no_grad():
        theirs = reference(input_ids=torch.tensor([ids])).logits[0]
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)
    assert torch.equal(ours.argmax(-1), theirs.argmax(-1))


def test_image_prompt_logits_match_transformers(k25_dir: Path, reference) -> None:
    """Two images (4x6 and 8x8 patches) in one prompt: the tower's rows replace their placeholders."""
    runner = runner_for(k25_dir)
    pad = runner.config.vision.media_placeholder_token_id
    g = torch.Generator().manual_seed(6)
    grids = ((4, 6), (8, 8))
    pixels = [
        torch.randint(0, 256, (h * PATCH, w * PATCH, 3), dtype=torch.uint8, generator=g) for h, w in grids
    ]
    patches = [normalized_patches(p, PATCH) for p in pixels]
    text = prompt(7, 20)
    ids = text[:5] + [pad] * 6 + text[5:12] + [pad] * 16 + text[12:]
    with torch.inference_mode():
        rows = torch.cat(
            [
                runner.model.vision_tower.encode_image(p, h, w)
                for p, (h, w) in zip(patches, grids, strict=True)
            ]
        )
        images = ImageEmbeddings(torch.tensor([i for i, t in enumerate(ids) if t == pad]), rows)
        meta = build_attention_metadata(
            [SequenceSpan(0, len(ids), list(range(-(-len(ids) // 4))), True)], 4, runner.device
        )
        meta.sample_indices = torch.arange(len(ids))
        ours = runner.model(torch.tensor(ids), torch.arange(len(ids)), meta, images)
    with torch.no_grad():
        out = reference(
            input_ids=torch.tensor([ids]),
            pixel_values=torch.cat(patches),
            image_grid_thw=torch.tensor([[1, h, w] for h, w in grids]),
        )
    torch.testing.assert_close(ours, out.logits[0], rtol=1e-4, atol=1e-4)
    text_only = prefill_logits(runner, ids)
    assert not torch.allclose(ours[-1], text_only[-1], atol=1e-3)  # the images did change the answer
