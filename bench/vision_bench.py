"""Image input on this CPU: what a picture costs to prepare and encode, what the prefix cache saves
when the same picture comes back, and what Kimi K2.5's INT4 experts save in memory.

- preparation: the tokenizer service's work per picture (PNG decode, resize to the patch grid,
  content hash), for a screenshot-sized and a photo-sized image, and for the same picture sent
  again ("again": its bytes hashed, the prepared image found in the tokenizer's cache);
- encoding: the engine's vision tower on the prepared pixels, for the tiny Kimi K2.5 checkpoint
  (``cachet model tiny --family kimi-k2.5``) and, unless ``--quick``, for MoonViT's published
  shape (27 layers, 1,152 wide; random weights) at 448x448;
- TTFT of a prompt holding a picture, cold and with the same picture sent again (the prefix
  cache), same engine, same process;
- memory of the routed experts stored as published (INT4, group scales) against bf16, for the
  tiny checkpoint and for Kimi K2.5's published expert shape.

`python -m bench.vision_bench [--quick]`; the ``vision`` section of ``make bench``.
"""

from __future__ import annotations

import argparse
import io
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
from PIL import Image
from safetensors import safe_open

from bench.engine_bench import EngineHarness, one_math_thread
from bench.progress import progress
from cachet.engine.models.config import VisionConfig
from cachet.engine.models.kimi_vision import KimiVisionTower, normalized_patches
from cachet.engine.prompt_images import PromptImage
from cachet.models.tiny import TINY_MODEL_IDS, write_tiny_model
from cachet.tokenizer.image_cache import PreparedImageCache
from cachet.tokenizer.images import ImageLimits, decode_rgb, resized_input
from cachet.tokenizer.model_info import VisionInfo

# Kimi K2.5 as published: 384 routed experts in each of 60 MoE layers, 7,168 -> 2,048 -> 7,168,
# INT4 with one bf16 scale per 32 weights.
K25_EXPERT_WEIGHTS = 384 * 60 * 3 * 7168 * 2048
K25_GROUP = 32
# MoonViT as published, with a random-weight tower of this shape standing in for the real one.
MOONVIT = {"hidden": 1152, "intermediate": 4304, "layers": 27, "heads": 16, "text_hidden": 7168}
SIZES = {"screenshot 1280x800": (1280, 800), "photo 640x480": (640, 480)}
_LIMITS = ImageLimits()


def _png(width: int, height: int, seed: int) -> bytes:
    generator = torch.Generator().manual_seed(seed)
    noise = torch.randint(0, 256, (height, width, 3), dtype=torch.uint8, generator=generator)
    buffer = io.BytesIO()
    Image.fromarray(noise.numpy()).save(buffer, format="PNG")
    return buffer.getvalue()


def _median_ms(run, rounds: int) -> float:
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        run()
        times.append((time.perf_counter() - start) * 1000)
    return statistics.median(times)


def _vision_info(vision: VisionConfig) -> VisionInfo:
    assert vision.media_placeholder_token_id is not None
    return VisionInfo(
        placeholder_token_id=vision.media_placeholder_token_id,
        placeholder_text="",
        patch_size=vision.patch_size,
        merge_kernel=vision.merge_kernel_size,
        max_patches=16384,
        max_patches_per_side=512,
    )


def _prompt_image(prepared, offset: int) -> PromptImage:
    return PromptImage(
        offset,
        prepared.num_tokens,
        prepared.grid_height,
        prepared.grid_width,
        prepared.pixels,
        prepared.content_hash,
    )


def _prepare_cached_ms(picture: bytes, info: VisionInfo, rounds: int) -> float:
    """A picture sent again: its bytes hashed, the prepared image found, a request's ImageInput built."""
    cache = PreparedImageCache()

    def prepare() -> None:
        cache.prepared(
            picture, info, lambda: resized_input(decode_rgb(picture, "bench", _LIMITS), info)
        ).to_proto()

    prepare()
    return _median_ms(prepare, rounds)


def _int4_memory(model_dir: Path) -> dict:
    packed = bf16 = 0
    with safe_open(str(model_dir / "model.safetensors"), "pt") as stored:
        for name in stored.keys():  # noqa: SIM118 - safe_open is not a mapping
            if name.endswith(("weight_packed", "weight_scale")):
                packed += stored.get_tensor(name).nbytes
            if name.endswith("weight_shape"):
                rows, columns = stored.get_tensor(name).tolist()
                bf16 += rows * columns * 2
    published_int4 = K25_EXPERT_WEIGHTS // 2 + K25_EXPERT_WEIGHTS // K25_GROUP * 2
    return {
        "tiny_int4_bytes": packed,
        "tiny_bf16_bytes": bf16,
        "kimi_k25_int4_gib": published_int4 / 1024**3,
        "kimi_k25_bf16_gib": K25_EXPERT_WEIGHTS * 2 / 1024**3,
    }


def _moonvit_encode_ms(vision: VisionConfig, dtype: torch.dtype) -> float:
    shape = VisionConfig(
        **{
            **vision.__dict__,
            "hidden_size": MOONVIT["hidden"],
            "intermediate_size": MOONVIT["intermediate"],
            "num_hidden_layers": MOONVIT["layers"],
            "num_attention_heads": MOONVIT["heads"],
            "pos_emb_grid": (64, 64, 4),
            "text_hidden_size": MOONVIT["text_hidden"],
        }
    )
    tower = KimiVisionTower(shape).to(dtype).eval()
    pixels = torch.randint(0, 256, (448, 448, 3), dtype=torch.uint8)
    grid = 448 // vision.patch_size

    def encode() -> None:
        with torch.inference_mode():
            tower.encode_image(normalized_patches(pixels, vision.patch_size).to(dtype), grid, grid)

    encode()
    return _median_ms(encode, 3)


def run_vision_bench(quick: bool = False, dtype: str = "float32") -> dict:
    torch_dtype = getattr(torch, dtype)
    rounds = 3 if quick else 7
    model_dir = write_tiny_model(
        Path(tempfile.mkdtemp(prefix="cachet-vision-bench-")) / "k25", family="kimi-k2.5"
    )
    progress(f"tiny Kimi K2.5 at {model_dir}, {torch_dtype}, one math thread")
    results: dict = {"model": TINY_MODEL_IDS["kimi-k2.5"], "dtype": str(torch_dtype), "images": {}}
    with one_math_thread():
        engine = EngineHarness(model_dir, TINY_MODEL_IDS["kimi-k2.5"], torch_dtype, max_batched_tokens=2048)
        runner = engine.runner
        assert runner.config.vision is not None and runner.image_encoder is not None
        vision = runner.config.vision
        info = _vision_info(vision)
        text = torch.randint(3, 1000, (64,), generator=torch.Generator().manual_seed(3)).tolist()
        for label, (width, height) in SIZES.items():
            progress(f"{label}: prepare, encode, TTFT cold and cached")
            pictures = [_png(width, height, seed) for seed in range(rounds)]
            prepare_ms = _median_ms(
                lambda first=pictures[0]: resized_input(decode_rgb(first, "bench", _LIMITS), info).to_proto(),
                rounds,
            )
            prepare_cached_ms = _prepare_cached_ms(pictures[0], info, rounds)
            # A new picture for each cold run: the engine keeps the tower's output by content.
            images = [
                _prompt_image(resized_input(decode_rgb(p, "bench", _LIMITS), info), len(text))
                for p in pictures
            ]
            image = images[0]

            def encode(image: PromptImage = image) -> None:
                with torch.inference_mode():
                    pixels = torch.frombuffer(bytearray(image.pixels), dtype=torch.uint8).view(
                        image.grid_height * vision.patch_size, image.grid_width * vision.patch_size, 3
                    )
                    runner.model.vision_tower.encode_image(
                        normalized_patches(pixels, vision.patch_size).to(torch_dtype),
                        image.grid_height,
                        image.grid_width,
                    )

            encode_ms = _median_ms(encode, rounds)
            ids = text + [info.placeholder_token_id] * image.num_tokens + text
            cold, cached = [], []
            for picture in images:
                cold.append(engine.time_to_first_token(ids, (picture,))[0] * 1000)
                cached.append(engine.time_to_first_token(ids, (picture,))[0] * 1000)
            results["images"][label] = {
                "image_tokens": image.num_tokens,
                "grid": [image.grid_height, image.grid_width],
                "prepare_ms": prepare_ms,
                "prepare_cached_ms": prepare_cached_ms,
                "encode_ms": encode_ms,
                "ttft_cold_ms": statistics.median(cold),
                "ttft_cached_ms": statistics.median(cached),
            }
        results["expert_memory"] = _int4_memory(model_dir)
        if not quick:
            progress("MoonViT's published shape (random weights), one 448x448 picture")
            results["moonvit_448_encode_ms"] = _moonvit_encode_ms(vision, torch_dtype)
    _print(results)
    return results


def _print(results: dict) -> None:
    print(f"\nImage input, {results['model']}, {results['dtype']}, one math thread")
    print(
        f"{'picture':<22}{'tokens':>8}{'prepare ms':>12}{'again':>8}{'encode ms':>11}{'TTFT cold':>11}"
        f"{'cached':>9}{'ratio':>7}"
    )
    for label, row in results["images"].items():
        ratio = row["ttft_cached_ms"] / row["ttft_cold_ms"]
        print(
            f"{label:<22}{row['image_tokens']:>8}{row['prepare_ms']:>12.1f}{row['prepare_cached_ms']:>8.2f}"
            f"{row['encode_ms']:>11.1f}"
            f"{row['ttft_cold_ms']:>11.1f}{row['ttft_cached_ms']:>9.1f}{ratio:>7.2f}"
        )
    memory = results["expert_memory"]
    print(
        f"routed experts, tiny: INT4 {memory['tiny_int4_bytes']:,} B vs bf16 {memory['tiny_bf16_bytes']:,} B "
        f"({memory['tiny_int4_bytes'] / memory['tiny_bf16_bytes']:.2f}x); Kimi K2.5: "
        f"{memory['kimi_k25_int4_gib']:.0f} GiB vs {memory['kimi_k25_bf16_gib']:.0f} GiB"
    )
    if "moonvit_448_encode_ms" in results:
        print(
            f"MoonViT (published shape, random weights), 448x448 (256 tokens): {results['moonvit_448_encode_ms']:.0f} ms"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args()
    print(json.dumps(run_vision_bench(quick=args.quick, dtype=args.dtype), indent=2))


if __name__ == "__main__":
    main()
