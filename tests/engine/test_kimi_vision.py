"""Kimi K2.5's vision tower against transformers' (Kimi_K25VisionModel + Kimi_K25MultimodalProjection).

Random weights are drawn once under the published checkpoint's names, loaded into the engine's
tower through the loader's own name mapping and into transformers' modules through the renames
its conversion mapping for ``kimi_k25`` applies (fused ``wqkv`` chunked, queries and keys
permuted by transformers' own ``PermuteForRope``). Images of grids other than the position
table's exercise the bicubic resampling.
"""

from __future__ import annotations

import re

import pytest
import torch

from cachet.engine.checkpoint_names import vision_parameter_name
from cachet.engine.models.config import VisionConfig, _vision_config
from cachet.engine.models.kimi_vision import KimiVisionTower, normalized_patches

PATCH = 14
TEXT_HIDDEN = 48
# The published vision_config's keys, at toy size.
VISION = {
    "patch_size": PATCH,
    "vt_hidden_size": 32,
    "vt_intermediate_size": 64,
    "vt_num_hidden_layers": 2,
    "vt_num_attention_heads": 2,
    "merge_kernel_size": [2, 2],
    "init_pos_emb_height": 8,
    "init_pos_emb_width": 8,
    "init_pos_emb_time": 4,
    "mm_projector_type": "patchmerger",
    "projector_hidden_act": "gelu",
    "projector_ln_eps": 1e-5,
    "text_hidden_size": TEXT_HIDDEN,
}
# (grid_h, grid_w): smaller than the 8x8 table, the table's own grid, and larger, non-square.
GRIDS = ((4, 6), (8, 8), (10, 12))


def published_vision_tensors(vision: VisionConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random vision tower + projector tensors under the published names and shapes."""
    g = torch.Generator().manual_seed(seed)
    d, inner, p = vision.hidden_size, vision.intermediate_size, vision.patch_size
    merged = d * vision.merge_kernel_size[0] * vision.merge_kernel_size[1]
    h, w, _ = vision.pos_emb_grid
    shapes: dict[str, tuple[int, ...]] = {
        "vision_tower.patch_embed.proj.weight": (d, 3, p, p),
        "vision_tower.patch_embed.proj.bias": (d,),
        "vision_tower.patch_embed.pos_emb.weight": (h, w, d),
        "vision_tower.encoder.final_layernorm.weight": (d,),
        "vision_tower.encoder.final_layernorm.bias": (d,),
        "mm_projector.pre_norm.weight": (d,),
        "mm_projector.pre_norm.bias": (d,),
        "mm_projector.proj.0.weight": (merged, merged),
        "mm_projector.proj.0.bias": (merged,),
        "mm_projector.proj.2.weight": (vision.text_hidden_size, merged),
        "mm_projector.proj.2.bias": (vision.text_hidden_size,),
    }
    for i in range(vision.num_hidden_layers):
        block = f"vision_tower.encoder.blocks.{i}."
        shapes |= {
            block + "norm0.weight": (d,),
            block + "norm0.bias": (d,),
            block + "norm1.weight": (d,),
            block + "norm1.bias": (d,),
            block + "wqkv.weight": (3 * d, d),
            block + "wqkv.bias": (3 * d,),
            block + "wo.weight": (d, d),
            block + "wo.bias": (d,),
            block + "mlp.fc0.weight": (inner, d),
            block + "mlp.fc0.bias": (inner,),
            block + "mlp.fc1.weight": (d, inner),
            block + "mlp.fc1.bias": (d,),
        }
    tensors = {}
    for name, shape in shapes.items():
        t = torch.randn(shape, generator=g)
        if name.endswith("norm0.weight") or name.endswith("norm1.weight") or "layernorm.weight" in name:
            t = 1 + 0.1 * t  # LayerNorm gains near one, as trained ones are
        elif "pre_norm.weight" in name:
            t = 1 + 0.1 * t
        elif name.endswith(".weight") and len(shape) >= 2 and "pos_emb" not in name:
            t = t / shape[-1] ** 0.5 if len(shape) == 2 else t / (3 * p * p) ** 0.5
        else:
            t = 0.1 * t
        tensors[name] = t
    return tensors


def engine_tower(vision: VisionConfig, tensors: dict[str, torch.Tensor]) -> KimiVisionTower:
    tower = KimiVisionTower(vision)
    # The loader's mapping: parameter ``vision_tower.<x>`` is the tower's ``<x>``.
    state = {vision_parameter_name(n).removeprefix("vision_tower."): t for n, t in tensors.items()}
    tower.load_state_dict(state, strict=True)
    return tower.eval()


def transformers_modules(tensors: dict[str, torch.Tensor]):
    modeling = pytest.importorskip("transformers.models.kimi_k25.modeling_kimi_k25")
    from transformers.core_model_loading import PermuteForRope
    from transformers.models.kimi_k25.configuration_kimi_k25 import Kimi_K25Config, Kimi_K25VisionConfig

    vision_config = Kimi_K25VisionConfig(
        patch_size=PATCH,
        hidden_size=VISION["vt_hidden_size"],
        intermediate_size=VISION["vt_intermediate_size"],
        num_hidden_layers=VISION["vt_num_hidden_layers"],
        num_attention_heads=VISION["vt_num_attention_heads"],
        pos_emb_height=VISION["init_pos_emb_height"],
        pos_emb_width=VISION["init_pos_emb_width"],
        pos_emb_time=VISION["init_pos_emb_time"],
    )
    config = Kimi_K25Config(
        vision_config=vision_config.to_dict(),
        text_config={"model_type": "deepseek_v3", "hidden_size": TEXT_HIDDEN},
        projection_hidden_size=VISION["vt_hidden_size"],
    )
    tower = modeling.Kimi_K25VisionModel(config.vision_config).eval()
    projector = modeling.Kimi_K25MultimodalProjection(config).eval()
    permute = PermuteForRope(subconfig_key="vision_config")
    tower_state, projector_state = {}, {}
    for name, t in tensors.items():
        if name.startswith("mm_projector."):
            key = (
                name.removeprefix("mm_projector.").replace("proj.0", "in_proj").replace("proj.2", "out_proj")
            )
            projector_state[key] = t
            continue
        key = name.removeprefix("vision_tower.").removeprefix("encoder.")
        key = key.replace("pos_emb.weight", "pos_emb.position_embeddings").replace("blocks.", "layers.")
        key = re.sub(r"\.norm1\.", ".norm2.", key)
        key = re.sub(r"\.norm0\.", ".norm1.", key)
        key = re.sub(r"\.mlp\.fc1\.", ".mlp.fc2.", key)
        key = re.sub(r"\.mlp\.fc0\.", ".mlp.fc1.", key)
        key = key.replace(".wo.", ".attn.proj.")
        if ".wqkv." in key:
            q, k, v = t.chunk(3, dim=0)
            suffix = key.rsplit(".", 1)[1]
            prefix = key.split(".wqkv.")[0] + ".attn."
            tower_state[prefix + "q_proj." + suffix] = permute._permute_for_rope(q, config)
            tower_state[prefix + "k_proj." + suffix] = permute._permute_for_rope(k, config)
            tower_state[prefix + "v_proj." + suffix] = v
            continue
        tower_state[key] = t
    tower.load_state_dict(tower_state, strict=True)
    projector.load_state_dict(projector_state, strict=True)
    return tower, projector


def test_tower_and_projector_match_transformers_for_images_of_different_grids() -> None:
    vision = _vision_config(VISION, placeholder=7)
    assert vision is not None
    tensors = published_vision_tensors(vision)
    ours = engine_tower(vision, tensors)
    tower, projector = transformers_modules(tensors)
    g = torch.Generator().manual_seed(1)
    images = [
        torch.randint(0, 256, (h * PATCH, w * PATCH, 3), dtype=torch.uint8, generator=g) for h, w in GRIDS
    ]
    patches = [normalized_patches(image, PATCH) for image in images]
    grid_thw = torch.tensor([[1, h, w] for h, w in GRIDS])
    with torch.no_grad():
        pooled = tower(torch.cat(patches), grid_thw=grid_thw).pooler_output
        theirs = projector(pooled).squeeze(1).split([h * w // 4 for h, w in GRIDS])
        for (h, w), image_patches, expected in zip(GRIDS, patches, theirs, strict=True):
            got = ours.encode_image(image_patches, h, w)
            assert got.shape == (h * w // 4, TEXT_HIDDEN) and got.dtype == torch.float32
            torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


def test_a_different_image_encodes_differently_and_position_matters() -> None:
    vision = _vision_config(VISION, placeholder=7)
    assert vision is not None
    ours = engine_tower(vision, published_vision_tensors(vision))
    g = torch.Generator().manual_seed(2)
    image = torch.randint(0, 256, (4 * PATCH, 6 * PATCH, 3), dtype=torch.uint8, generator=g)
    flipped = image.flip(1)
    with torch.no_grad():
        a = ours.encode_image(normalized_patches(image, PATCH), 4, 6)
        b = ours.encode_image(normalized_patches(flipped, PATCH), 4, 6)
    assert not torch.allclose(a, b, atol=1e-3)


def test_bf16_tower_returns_the_models_dtype_close_to_fp32() -> None:
    vision = _vision_config(VISION, placeholder=7)
    assert vision is not None
    tensors = published_vision_tensors(vision)
    fp32 = engine_tower(vision, tensors)
    bf16 = engine_tower(vision, tensors).to(torch.bfloat16)
    g = torch.Generator().manual_seed(3)
    patches = normalized_patches(
        torch.randint(0, 256, (8 * PATCH, 4 * PATCH, 3), dtype=torch.uint8, generator=g), PATCH
    )
    with torch.no_grad():
        low = bf16.encode_image(patches, 8, 4)
        high = fp32.encode_image(patches, 8, 4)
    assert low.dtype == torch.bfloat16
    torch.testing.assert_close(low.float(), high, rtol=0.05, atol=0.05)


def test_normalized_patches_rescale_normalise_and_order_row_major() -> None:
    """transformers' Kimi_K25ImageProcessor needs torchvision, which this environment lacks (it
    does not install beside torch 2.13): its steps are written out here instead: x / 255, then
    (x - 0.5) / 0.5 per channel, then its ``patchify`` (grid row-major, channels first)."""
    g = torch.Generator().manual_seed(4)
    pixels = torch.randint(0, 256, (2 * PATCH, 3 * PATCH, 3), dtype=torch.uint8, generator=g)
    patches = normalized_patches(pixels, PATCH)
    assert patches.shape == (6, 3, PATCH, PATCH) and patches.dtype == torch.float32
    chw = (pixels.permute(2, 0, 1).float() * (1 / 255) - 0.5) / 0.5
    for row in range(2):
        for col in range(3):
            expected = chw[:, row * PATCH : (row + 1) * PATCH, col * PATCH : (col + 1) * PATCH]
            torch.testing.assert_close(patches[row * 3 + col], expected, rtol=0, atol=1e-6)
    assert patches.min() >= -1 and patches.max() <= 1
    with pytest.raises(ValueError, match="whole 14-pixel patches"):
        normalized_patches(pixels[:20], PATCH)
