"""Kimi K2.5's vision tower (MoonViT) and its projector into the language model's width.

One image at a time, at its own resolution:

    pixels [H, W, 3] uint8 --normalized_patches--> [gh*gw, 3, p, p]     (p = 14, row-major grid)
      patch_embed.proj    Conv2d p x p, stride p           -> [gh*gw, D]
      + patch_embed.pos_emb  learned [64, 64, D] table, bicubically resampled to [gh, gw]
      encoder.blocks x N  pre-norm ViT block: full attention over the image's patches with 2-D
                          RoPE (a patch's column and row), then a GELU(tanh) MLP
      encoder.final_layernorm
      2x2 merge           [gh/2 * gw/2, 4, D]: each 2x2 block of patches, row-major over blocks
      mm_projector        LayerNorm per patch, concat the 4 -> in_proj (proj.0), GELU,
                          out_proj (proj.2) to the text hidden size
    -> [gh*gw/4, text_hidden]: one row per ``<|media_pad|>`` placeholder, in prompt order

Parameter names are the published checkpoint's (``vision_tower.encoder.blocks.{i}.wqkv`` ...)
so the loader fills them by name; ``mm_projector.*`` is stored beside ``vision_tower.*`` but
lives inside this module (``PROJECTOR_PARAMETER_PREFIX``). The checkpoint's fused ``wqkv`` keeps
MoonViT's own RoPE layout: each rotated pair is two adjacent channels of a head (as a complex
number), so queries and keys are de-interleaved here, not their weights permuted at load.

Only still images: the checkpoint's temporal position table (video frames) adds nothing to a
single frame, so it is not built. Under tensor parallelism every rank holds the whole tower
(about 0.4B parameters in K2.5, next to a trillion in the language model): no slicing, no
collective; each rank can encode what its own step needs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from cachet.engine.models.config import UnsupportedModelError, VisionConfig
from cachet.engine.models.rotary import apply_rotary

# The published image processor rescales to [0, 1], then normalises with mean = std = 0.5.
_PIXEL_MEAN = 0.5
_PIXEL_STD = 0.5
_ROPE_THETA = 10000.0
# MoonViT's own LayerNorms inside the tower use the torch default; the config names only the
# projector's.
_TOWER_LN_EPS = 1e-5


def normalized_patches(pixels: torch.Tensor, patch_size: int) -> torch.Tensor:
    """uint8 RGB [H, W, 3] (H, W multiples of patch_size) -> float32 [grid_h*grid_w, 3, patch, patch],
    rescaled to [0,1] and normalised with mean=std=0.5 as Kimi K2.5's image processor does, patch order
    as its processor (row-major over the patch grid)."""
    height, width, channels = pixels.shape
    if channels != 3 or height % patch_size or width % patch_size:
        raise ValueError(f"pixels {tuple(pixels.shape)} are not RGB in whole {patch_size}-pixel patches")
    x = (pixels.float() / 255.0 - _PIXEL_MEAN) / _PIXEL_STD
    gh, gw = height // patch_size, width // patch_size
    # [gh, p, gw, p, 3] -> [gh, gw, 3, p, p]
    x = x.view(gh, patch_size, gw, patch_size, 3).permute(0, 2, 4, 1, 3)
    return x.reshape(gh * gw, 3, patch_size, patch_size).contiguous()


class PositionTable(nn.Module):
    """The learned [h0, w0, D] position table, resampled (bicubic, half-pixel centres) to an
    image's patch grid; an image of exactly the table's grid reads it as stored."""

    def __init__(self, height: int, width: int, dim: int) -> None:
        super().__init__()
        # A defined init (not torch.empty): a tower built without a checkpoint, as tests build their
        # random checkpoints, must not carry whatever memory held (NaN breaks equality).
        self.weight = nn.Parameter(torch.empty(height, width, dim))
        nn.init.normal_(self.weight, std=0.02)

    def forward(self, grid_h: int, grid_w: int) -> torch.Tensor:
        """-> [grid_h * grid_w, D], row-major, fp32."""
        table = self.weight.float()
        if (grid_h, grid_w) != tuple(table.shape[:2]):
            resampled = F.interpolate(
                table.permute(2, 0, 1)[None], size=(grid_h, grid_w), mode="bicubic", align_corners=False
            )
            table = resampled[0].permute(1, 2, 0)
        return table.reshape(grid_h * grid_w, -1)


class PatchEmbed(nn.Module):
    def __init__(self, vision: VisionConfig) -> None:
        super().__init__()
        p = vision.patch_size
        self.proj = nn.Conv2d(3, vision.hidden_size, kernel_size=p, stride=p)
        height, width, _frames = vision.pos_emb_grid
        self.pos_emb = PositionTable(height, width, vision.hidden_size)

    def forward(self, patches: torch.Tensor, grid_h: int, grid_w: int) -> torch.Tensor:
        x = self.proj(patches).flatten(1)  # [N, D, 1, 1] -> [N, D]
        return x + self.pos_emb(grid_h, grid_w).to(x.dtype)


def axial_rope(
    head_dim: int, grid_h: int, grid_w: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [grid_h*grid_w, head_dim] for de-interleaved queries and keys (rotate-half layout).

    MoonViT rotates head_dim/2 channel pairs; pair 2k turns by column * f_k and pair 2k+1 by
    row * f_k, with f_k = theta^(-4k / head_dim): both axes share one frequency ladder.
    """
    freqs = _ROPE_THETA ** (-torch.arange(0, head_dim, 4, device=device, dtype=torch.float32) / head_dim)
    rows, cols = torch.meshgrid(
        torch.arange(grid_h, device=device, dtype=torch.float32),
        torch.arange(grid_w, device=device, dtype=torch.float32),
        indexing="ij",
    )
    # [N, head_dim/4, 2]: (column, row) angles side by side, then flattened to one per pair.
    angles = torch.stack((cols.reshape(-1, 1) * freqs, rows.reshape(-1, 1) * freqs), dim=-1).flatten(1)
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos(), angles.sin()


def _deinterleave(x: torch.Tensor) -> torch.Tensor:
    """Pairs (x0, x1), (x2, x3)... -> [evens | odds]: the rotate-half layout of the same rotation.
    Queries and keys move alike, so their dot products are unchanged."""
    return torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)


class VisionBlock(nn.Module):
    """x + wo(attention(norm0(x))), then x + mlp(norm1(x)); attention spans the whole image."""

    def __init__(self, vision: VisionConfig) -> None:
        super().__init__()
        dim = vision.hidden_size
        self.num_heads = vision.num_attention_heads
        self.norm0 = nn.LayerNorm(dim, eps=_TOWER_LN_EPS)
        self.wqkv = nn.Linear(dim, 3 * dim)
        self.wo = nn.Linear(dim, dim)
        self.norm1 = nn.LayerNorm(dim, eps=_TOWER_LN_EPS)
        self.mlp = VisionMLP(dim, vision.intermediate_size)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.wo(self._attention(self.norm0(x), cos, sin))
        return x + self.mlp(self.norm1(x))

    def _attention(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        tokens = x.shape[0]
        q, k, v = self.wqkv(x).view(tokens, 3, self.num_heads, -1).unbind(1)  # each [N, H, d]
        # Rotate in fp32 (bf16 angles drift at large grids), attend in the model's dtype.
        q = apply_rotary(_deinterleave(q).float(), cos, sin).to(x.dtype)
        k = apply_rotary(_deinterleave(k).float(), cos, sin).to(x.dtype)
        out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1))
        return out.transpose(0, 1).reshape(tokens, -1)


class VisionMLP(nn.Module):
    def __init__(self, dim: int, inner: int) -> None:
        super().__init__()
        self.fc0 = nn.Linear(dim, inner)
        self.fc1 = nn.Linear(inner, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc1(F.gelu(self.fc0(x), approximate="tanh"))


class VisionEncoder(nn.Module):
    def __init__(self, vision: VisionConfig) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(VisionBlock(vision) for _ in range(vision.num_hidden_layers))
        self.final_layernorm = nn.LayerNorm(vision.hidden_size, eps=_TOWER_LN_EPS)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x, cos, sin)
        return self.final_layernorm(x)


class Projector(nn.Module):
    """A merged 2x2 block of patches -> one token of the language model's width."""

    def __init__(self, vision: VisionConfig) -> None:
        super().__init__()
        if vision.projector_type != "patchmerger" or vision.projector_hidden_act != "gelu":
            raise UnsupportedModelError(
                f"projector {vision.projector_type!r} with {vision.projector_hidden_act!r} is not "
                "supported (only patchmerger with gelu)"
            )
        merged = vision.hidden_size * vision.merge_kernel_size[0] * vision.merge_kernel_size[1]
        self.pre_norm = nn.LayerNorm(vision.hidden_size, eps=vision.projector_ln_eps)
        # proj.0 / proj.2: the checkpoint's names for in_proj and out_proj around the GELU.
        self.proj = nn.Sequential(
            nn.Linear(merged, merged), nn.GELU(), nn.Linear(merged, vision.text_hidden_size)
        )

    def forward(self, blocks: torch.Tensor) -> torch.Tensor:
        """[M, k, D] merged blocks -> [M, text_hidden]."""
        return self.proj(self.pre_norm(blocks).flatten(1))


class KimiVisionTower(nn.Module):
    """MoonViT plus its projector: an image's patches in, its placeholder tokens' embeddings out."""

    def __init__(self, vision: VisionConfig) -> None:
        super().__init__()
        if (
            vision.hidden_size % vision.num_attention_heads
            or (vision.hidden_size // vision.num_attention_heads) % 4
        ):
            raise UnsupportedModelError(
                f"vision hidden size {vision.hidden_size} over {vision.num_attention_heads} heads: "
                "2-D RoPE needs a head width divisible by 4"
            )
        self.vision = vision
        self.patch_embed = PatchEmbed(vision)
        self.encoder = VisionEncoder(vision)
        self.mm_projector = Projector(vision)

    def encode_image(self, patches: torch.Tensor, grid_h: int, grid_w: int) -> torch.Tensor:
        """[grid_h*grid_w, 3, p, p] -> [grid_h*grid_w // 4, text_hidden_size] in the model's dtype, rows in the
        order of the image's placeholder tokens in the prompt (as transformers' Kimi K2.5 places them)."""
        kh, kw = self.vision.merge_kernel_size
        if patches.shape[0] != grid_h * grid_w or grid_h % kh or grid_w % kw:
            raise ValueError(f"{patches.shape[0]} patches for a {grid_h}x{grid_w} grid (merged {kh}x{kw})")
        dtype = self.patch_embed.proj.weight.dtype
        x = self.patch_embed(patches.to(dtype), grid_h, grid_w)
        head_dim = self.vision.hidden_size // self.vision.num_attention_heads
        cos, sin = axial_rope(head_dim, grid_h, grid_w, x.device)
        x = self.encoder(x, cos, sin)
        # [gh, gw, D] -> [gh/kh, kh, gw/kw, kw, D] -> [gh/kh, gw/kw, kh, kw, D]: one row per block,
        # blocks row-major, each block's patches row-major.
        blocks = x.view(grid_h // kh, kh, grid_w // kw, kw, -1).permute(0, 2, 1, 3, 4)
        return self.mm_projector(blocks.reshape((grid_h // kh) * (grid_w // kw), kh * kw, -1))


__all__ = ["KimiVisionTower", "axial_rope", "normalized_patches"]
