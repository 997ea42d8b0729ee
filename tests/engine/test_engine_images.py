"""Images through the engine's own request path (EngineCore: scheduler, KV cache, runner) on the
tiny Kimi K2.5 checkpoint, against transformers' Kimi_K25ForConditionalGeneration (fp32).

What is checked here and not by the model-level parity test: prompt chunks that cut through an
image take the right rows of the tower's output; the prefix cache names an image's blocks by its
content, so the same picture again is a cache hit with the same tokens, and a changed pixel is a
hit only up to the block before the image.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch
from deepseek_ep_worker import prompt, runner_for
from test_kimi_k25_tiny import dequantized_dir, k25_dir, reference  # noqa: F401 - fixtures

from cachet.engine.engine_core import EngineCore
from cachet.engine.models.kimi_vision import normalized_patches
from cachet.engine.prompt_images import PromptImage
from cachet.engine.request import Request
from cachet.engine.sampling_params import SamplingParams
from cachet.engine.scheduler import SchedulerConfig

PATCH = 14
NEW_TOKENS = 5


def picture(seed: int, grid_h: int, grid_w: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (grid_h * PATCH, grid_w * PATCH, 3), dtype=torch.uint8, generator=generator)


def prompt_image(pixels: torch.Tensor, offset: int) -> PromptImage:
    grid_h, grid_w = pixels.shape[0] // PATCH, pixels.shape[1] // PATCH
    raw = pixels.contiguous().numpy().tobytes()
    digest = hashlib.sha256(grid_h.to_bytes(4, "little") + grid_w.to_bytes(4, "little") + raw).digest()
    return PromptImage(offset, grid_h * grid_w // 4, grid_h, grid_w, raw, digest)


def image_prompt(pad: int, pictures: list[torch.Tensor]) -> tuple[list[int], tuple[PromptImage, ...]]:
    """Text, an image, text, an image, text: the images' tokens cross block and chunk edges."""
    text = prompt(11, 24)
    ids, images = list(text[:5]), []
    for pixels, cut in zip(pictures, (13, 24), strict=True):
        image = prompt_image(pixels, len(ids))
        images.append(image)
        ids += [pad] * image.num_tokens
        ids += text[len(ids) - sum(i.num_tokens for i in images) : cut]
    return ids, tuple(images)


class Engine:
    def __init__(self, model_dir: Path, chunk_tokens: int) -> None:
        self.runner = runner_for(model_dir)
        self.core = EngineCore(
            self.runner,
            model="tiny-kimi-k2.5",
            scheduler_config=SchedulerConfig(
                max_model_len=256, max_num_batched_tokens=chunk_tokens, max_num_seqs=4
            ),
        )
        self._ids = 0

    def generate(self, ids: list[int], images: tuple[PromptImage, ...]) -> tuple[list[int], int]:
        """(greedy tokens, cached prompt tokens)."""
        self._ids += 1
        rid = f"r{self._ids}"
        sampling = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS)
        self.core.add_request(Request(rid, list(ids), sampling, max_tokens=NEW_TOKENS, images=images))
        tokens, cached = [], 0
        while self.core.has_unfinished_requests():
            for output in self.core.step():
                tokens += output.new_token_ids
                cached = max(cached, output.num_cached_tokens)
        return tokens, cached


def reference_greedy(model, ids: list[int], pictures: list[torch.Tensor]) -> list[int]:
    patches = torch.cat([normalized_patches(p, PATCH) for p in pictures])
    grids = torch.tensor([[1, p.shape[0] // PATCH, p.shape[1] // PATCH] for p in pictures])
    tokens = list(ids)
    with torch.no_grad():
        for _ in range(NEW_TOKENS):
            logits = model(
                input_ids=torch.tensor([tokens]), pixel_values=patches, image_grid_thw=grids
            ).logits
            tokens.append(int(logits[0, -1].argmax()))
    return tokens[len(ids) :]


@pytest.mark.parametrize("chunk_tokens", [256, 7])
def test_greedy_tokens_with_images_equal_transformers(k25_dir: Path, reference, chunk_tokens: int) -> None:  # noqa: F811
    engine = Engine(k25_dir, chunk_tokens)
    pad = engine.runner.image_input.placeholder_token_id
    pictures = [picture(1, 4, 6), picture(2, 8, 8)]
    ids, images = image_prompt(pad, pictures)
    tokens, _ = engine.generate(ids, images)
    assert tokens == reference_greedy(reference, ids, pictures)
    assert engine.runner.image_encoder.images_encoded == 2  # once each, however many chunks


def test_the_same_picture_is_a_cache_hit_and_a_changed_pixel_is_not(k25_dir: Path) -> None:  # noqa: F811
    engine = Engine(k25_dir, 256)
    pad = engine.runner.image_input.placeholder_token_id
    pictures = [picture(1, 4, 6), picture(2, 8, 8)]
    ids, images = image_prompt(pad, pictures)
    cold, cached_cold = engine.generate(ids, images)
    again, cached_again = engine.generate(ids, images)
    assert cached_cold == 0
    assert again == cold
    assert cached_again == (len(ids) - 1) // engine.runner.block_size * engine.runner.block_size

    changed = pictures[1].clone()
    changed[3, 5, 1] ^= 1
    ids_changed, images_changed = image_prompt(pad, [pictures[0], changed])
    assert ids_changed == ids
    _, cached_changed = engine.generate(ids_changed, images_changed)
    second_image_block = images_changed[1].token_offset // engine.runner.block_size
    assert cached_changed == second_image_block * engine.runner.block_size

    # Same pixels, placeholders at the same places: text-only ids never hit the image's blocks.
    _, cached_text = engine.generate(ids, ())
    first_image_block = images[0].token_offset // engine.runner.block_size
    assert cached_text == first_image_block * engine.runner.block_size
