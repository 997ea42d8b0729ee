"""Kimi K2.5 as Moonshot publishes it: every stored tensor name maps to the model code.

No weights: the published config and tensor listing (fixtures/kimi_k25, see SOURCES.md)
against a meta-device model of that config, through the loader's own planning
(``group_checkpoint_names`` + ``plan_load``). A name nothing claims fails the test.
"""

from __future__ import annotations

import itertools
import json
import math
import re
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from torch import nn

from cachet.engine.checkpoint_names import PACKED_INT, PLAIN, group_checkpoint_names
from cachet.engine.models import model_class
from cachet.engine.models.config import (
    Fp8BlockQuantization,
    ModelConfig,
    PackedIntQuantization,
    UnsupportedModelError,
)
from cachet.engine.weights import plan_load

FIXTURE = Path(__file__).parent / "fixtures" / "kimi_k25"
# The report's own totals for the published checkpoint.
PUBLISHED_TENSORS = 208_550
PUBLISHED_ELEMENTS = 170_738_182_128
VISION_TOWER_TENSORS = 329  # 27 blocks x 12, the final norm's 2, patch embedding 2, positions 1
PROJECTOR_TENSORS = 6
_RANGE = re.compile(r"\{(\d+)-(\d+)\}")


def published_tensors() -> dict[str, tuple[str, tuple[int, ...]]]:
    """name -> (dtype, shape), every ``{a-b}`` range of the listing expanded."""
    tensors: dict[str, tuple[str, tuple[int, ...]]] = {}
    for line in (FIXTURE / "tensors.tsv").read_text().splitlines():
        pattern, dtype, shape = line.split("\t")
        ranges = [range(int(a), int(b) + 1) for a, b in _RANGE.findall(pattern)]
        template = _RANGE.sub("{}", pattern)
        for values in itertools.product(*ranges):
            tensors[template.format(*values)] = (dtype, tuple(int(d) for d in shape.split(",")))
    return tensors


def published_config() -> dict:
    return json.loads((FIXTURE / "config.json").read_text())


@pytest.fixture(scope="module")
def tensors() -> dict[str, tuple[str, tuple[int, ...]]]:
    return published_tensors()


@pytest.fixture(scope="module")
def config() -> ModelConfig:
    return ModelConfig.from_model_dir(FIXTURE)


@pytest.fixture(scope="module")
def meta_model(config: ModelConfig) -> nn.Module:
    # 70k linears: their random init (a no-op on meta, but a slow one) is skipped.
    with pytest.MonkeyPatch.context() as patch, torch.device("meta"):
        patch.setattr(nn.Linear, "reset_parameters", lambda self: None)
        patch.setattr(nn.Embedding, "reset_parameters", lambda self: None)
        return model_class(config)(config)


def test_listing_expands_to_the_published_totals(tensors: dict) -> None:
    assert len(tensors) == PUBLISHED_TENSORS
    assert sum(math.prod(shape) for _, shape in tensors.values()) == PUBLISHED_ELEMENTS


def test_multimodal_config_gives_the_text_model_and_its_vision_tower(config: ModelConfig) -> None:
    assert config.model_type == "deepseek_v3"
    assert (config.num_hidden_layers, config.hidden_size, config.vocab_size) == (61, 7168, 163840)
    assert config.mla is not None and config.moe is not None
    assert (config.mla.q_lora_rank, config.mla.kv_lora_rank, config.mla.qk_rope_head_dim) == (1536, 512, 64)
    assert (config.moe.n_routed_experts, config.moe.num_experts_per_tok) == (384, 8)
    assert config.moe.routed_scaling_factor == 2.827 and config.moe.norm_topk_prob
    assert config.rope.rope_type == "yarn" and config.rope.factor == 64.0
    assert config.max_position_embeddings == 262144
    assert config.quantization == PackedIntQuantization(
        num_bits=4,
        group_size=32,
        ignore=(
            "lm_head",
            "re:.*self_attn.*",
            "re:.*shared_experts.*",
            r"re:.*mlp\.(gate|up|gate_up|down)_proj.*",
        ),
    )
    assert config.checkpoint_prefix == "language_model."
    assert (config.bos_token_id, config.eos_token_ids) == (163584, (163585,))
    vision = config.vision
    assert vision is not None
    assert (vision.num_hidden_layers, vision.hidden_size, vision.num_attention_heads) == (27, 1152, 16)
    assert (vision.patch_size, vision.merge_kernel_size, vision.text_hidden_size) == (14, (2, 2), 7168)
    assert vision.pos_emb_grid == (64, 64, 4)
    assert vision.media_placeholder_token_id == 163605


def test_every_published_tensor_fills_a_parameter(
    tensors: dict, config: ModelConfig, meta_model: nn.Module
) -> None:
    names = group_checkpoint_names(tensors, config)
    plan = plan_load(meta_model, names)
    assert plan.unexpected == []
    assert plan.missing == []
    assert len(names.vision) == VISION_TOWER_TENSORS + PROJECTOR_TENSORS
    assert {n.split(".")[0] for n in names.vision} == {"vision_tower", "mm_projector"}
    # The tower and its projector are the model's ``vision_tower`` module, filled name for name
    # (the projector's stored ``mm_projector.x`` is its ``vision_tower.mm_projector.x``).
    vision_fills = {
        f.stored.parts["weight"]: f.param for f in plan.fills if f.param.startswith("vision_tower.")
    }
    assert sorted(vision_fills) == sorted(names.vision)
    assert vision_fills["mm_projector.proj.2.weight"] == "vision_tower.mm_projector.proj.2.weight"
    assert (
        vision_fills["vision_tower.encoder.blocks.26.wqkv.weight"]
        == "vision_tower.encoder.blocks.26.wqkv.weight"
    )
    assert meta_model.vision_tower is not None
    # Every routed expert's three linears are packed INT4; everything else is stored plain.
    formats = {fill.stored.name: fill.stored.format for fill in plan.fills}
    assert sum(f == PACKED_INT for f in formats.values()) == 60 * 384 * 3
    assert all((f == PACKED_INT) == (".experts." in n) for n, f in formats.items())
    # Each stored tensor has the shape of the parameter it fills (packed: once unpacked).
    params = dict(meta_model.named_parameters())
    for fill in plan.fills:
        assert fill.rows is None and fill.part is None  # one rank, no merged parameters here
        assert _stored_shape(fill.stored, tensors) == tuple(params[fill.param].shape), fill.stored.name
    assert len(plan.fills) == len(params)


def _stored_shape(stored, tensors: dict) -> tuple[int, ...]:
    if stored.format == PLAIN:
        return tensors[stored.parts["weight"]][1]
    dtype, (rows, words) = tensors[stored.parts["weight_packed"]]
    _, (scale_rows, groups) = tensors[stored.parts["weight_scale"]]
    assert dtype == "I32" and scale_rows == rows and tensors[stored.parts["weight_shape"]][1] == (2,)
    assert words * 32 // 4 == groups * 32  # 8 INT4 values per word, 32 per group
    return (rows, words * 8)


def test_an_unclaimed_or_missing_name_is_reported(
    tensors: dict, config: ModelConfig, meta_model: nn.Module
) -> None:
    stray = [
        "language_model.model.layers.3.self_attn.q_proj.weight",  # K2.5 has q_a/q_b, no q_proj
        "model.layers.0.input_layernorm.weight",  # outside the language model's prefix
        "language_model.model.layers.2.mlp.experts.7.up_proj.weight_zero_point",
    ]
    names = {**tensors, **dict.fromkeys(stray, ("BF16", (1,)))}
    dropped = "language_model.model.layers.5.mlp.experts.9.down_proj.weight_scale"
    del names[dropped]
    plan = plan_load(meta_model, group_checkpoint_names(names, config))
    expert = "language_model.model.layers.5.mlp.experts.9.down_proj."
    assert plan.unexpected == sorted(
        [*stray[:2], stray[2], expert + "weight_packed", expert + "weight_shape"]
    )
    assert plan.missing == ["model.layers.5.mlp.experts.9.down_proj.weight"]


def test_k2_thinking_layout_the_same_names_without_the_wrapper(tensors: dict) -> None:
    """K2 Thinking is text-only (model_type kimi_k2) with the same INT4 experts at the top level;
    its names are K2.5's language model's without ``language_model.`` (no public index copy found)."""
    raw = published_config()
    text = {**raw["text_config"], "model_type": "kimi_k2", "num_hidden_layers": 2}
    config = ModelConfig.from_dict(text)
    assert config.checkpoint_prefix == "" and config.vision is None
    assert isinstance(config.quantization, PackedIntQuantization)
    names = [
        n.removeprefix("language_model.")
        for n in tensors
        if n.startswith("language_model.") and not re.search(r"layers\.([2-9]|\d\d)\.", n)
    ]
    with pytest.MonkeyPatch.context() as patch, torch.device("meta"):
        patch.setattr(nn.Linear, "reset_parameters", lambda self: None)
        model = model_class(config)(config)
    plan = plan_load(model, group_checkpoint_names(names, config))
    assert (plan.unexpected, plan.missing) == ([], [])


def test_k2_instruct_fp8_config() -> None:
    raw = {**published_config()["text_config"], "model_type": "kimi_k2"}
    raw["quantization_config"] = {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "weight_block_size": [128, 128],
    }
    assert ModelConfig.from_dict(raw).quantization == Fp8BlockQuantization(block=(128, 128))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda c: c.update(model_type="kimi_k3"), "model_type 'kimi_k3' is not supported"),
        (lambda c: c["text_config"].update(model_type="qwen3"), "text_config has model_type 'qwen3'"),
        (lambda c: c.pop("text_config"), "needs a text_config"),
        (
            lambda c: c["text_config"]["quantization_config"].update(format="float-quantized"),
            "format 'float-quantized' is not supported",
        ),
        (
            lambda c: c["text_config"]["quantization_config"]["config_groups"]["group_0"]["weights"].update(
                symmetric=False
            ),
            "asymmetric",
        ),
        (
            lambda c: c["text_config"]["quantization_config"].update(quant_method="awq"),
            "quant_method 'awq' is not supported",
        ),
    ],
)
def test_what_the_engine_cannot_run_is_refused_by_name(change, message: str) -> None:
    raw = published_config()
    change(raw)
    with pytest.raises(UnsupportedModelError, match=re.escape(message)):
        ModelConfig.from_dict(raw)


def test_kept_packed_experts_take_the_published_parts_by_name(tensors: dict) -> None:
    """Where the INT4 kernel serves (bf16 on a CPU), each expert part fills its namesake."""
    config = ModelConfig.from_model_dir(FIXTURE)
    assert isinstance(config.quantization, PackedIntQuantization)
    config = replace(config, num_hidden_layers=2, quantization=replace(config.quantization, keep_packed=True))
    names = {n: v for n, v in tensors.items() if not re.search(r"layers\.([2-9]|\d\d)\.", n)}
    with pytest.MonkeyPatch.context() as patch, torch.device("meta"):
        patch.setattr(nn.Linear, "reset_parameters", lambda self: None)
        model = model_class(config)(config)
    plan = plan_load(model, group_checkpoint_names(names, config))
    assert (plan.unexpected, plan.missing) == ([], [])
    params = dict(model.named_parameters())
    packed = [fill for fill in plan.fills if ".experts." in fill.param]
    assert len(packed) == 384 * 3 * 3
    for fill in packed:
        assert tensors[fill.stored.parts["weight"]][1] == tuple(params[fill.param].shape), fill.param
