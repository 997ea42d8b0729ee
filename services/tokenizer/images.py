"""An ``image_url`` content part turned into the ``ImageInput`` the engine's vision encoder reads.

1. The bytes: a ``data:image/...;base64,...`` URL, or an http(s) URL whose host is on the
   operator's allow-list (``image_url_hosts``), fetched once: no redirects, a size cap, a deadline.
2. The picture: decoded by Pillow (PNG, JPEG, WebP, GIF's first frame), EXIF orientation
   applied, transparency composited onto white and converted to RGB, as transformers'
   ``load_image`` and ``convert_to_rgb`` do.
3. The size: Kimi K2.5's ``navit_resize`` (``navit_size``): scaled down, never up, until it
   fits the patch budget, resampled bicubic, then zero-padded on the bottom and right to whole
   merge windows (patch * merge pixels). The pixels travel as uint8; the engine normalises them
   (mean = std = 0.5), so padding with 0 here is the processor's padding before normalisation.

Steps 2 and 3 are the costly ones (tens of milliseconds for a screenshot), and agents send the
same pictures again every turn: ``image_cache.PreparedImageCache`` keeps their result by the
SHA-256 of the bytes of step 1, so a picture already seen is only read and hashed.

Every failure is an ``InvalidArgument`` naming the part (``messages[2].content[1].image_url``):
the REST bridge answers 400, never 500.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import math
import struct
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

import httpx
from PIL import Image, ImageOps

from cachet.common.v1 import common_pb2
from cachet.errors import InvalidArgument
from cachet.tokenizer.model_info import VisionInfo

if TYPE_CHECKING:  # image_cache imports PreparedImage from here
    from cachet.tokenizer.image_cache import PreparedImageCache

# What Pillow may decode: the formats OpenAI accepts. Naming them keeps Pillow's rarer
# decoders (and their bugs) out of reach of request bodies.
FORMATS = ("PNG", "JPEG", "WEBP", "GIF")


@dataclass(frozen=True)
class ImageLimits:
    """The operator's caps on image input (``TokenizerSettings.image_*``)."""

    max_bytes: int = 20 * 1024 * 1024
    max_pixels: int = 50_000_000
    max_images: int = 16
    # All of one request's resized pixels: they travel in one gRPC message, whose size is capped.
    max_total_pixel_bytes: int = 48 * 1024 * 1024
    url_hosts: frozenset[str] = frozenset()
    fetch_timeout_seconds: float = 10.0


def _invalid(field: str, problem: str) -> InvalidArgument:
    return InvalidArgument(f"{field}: {problem}", param=field)


def navit_size(height: int, width: int, vision: VisionInfo) -> tuple[tuple[int, int], tuple[int, int]]:
    """((resized height, width), (padded height, width)) of an image, in pixels, as Kimi K2.5's
    processor computes them: one scale for both sides, the most restrictive of the total patch
    budget, the per-side budget and 1 (never upscale); then each side rounded up to whole merge
    windows. Integer arithmetic where the reference's floats hold integers, so results agree."""
    patch = vision.patch_size
    patches = max(1, height // patch) * max(1, width // patch)
    side_pixels = vision.max_patches_per_side * patch
    scale = min(1.0, math.sqrt(vision.max_patches / patches), side_pixels / height, side_pixels / width)
    resized_h = min(max(1, int(height * scale)), side_pixels)
    resized_w = min(max(1, int(width * scale)), side_pixels)
    window_h, window_w = (patch * merge for merge in vision.merge_kernel)
    return (resized_h, resized_w), (_round_up(resized_h, window_h), _round_up(resized_w, window_w))


def _round_up(value: int, multiple: int) -> int:
    return (value + multiple - 1) // multiple * multiple


def content_hash(grid_height: int, grid_width: int, pixels: bytes) -> bytes:
    """SHA-256 of the grid and the pixels: the image's name in block hashes and encoder caches."""
    return hashlib.sha256(struct.pack("<II", grid_height, grid_width) + pixels).digest()


@dataclass(frozen=True, repr=False)
class PreparedImage:
    """An image at the model's resolution, as the engine reads it. Immutable (``pixels`` is
    ``bytes``): one cached copy is shared by every request that sends the picture."""

    num_tokens: int
    grid_height: int
    grid_width: int
    # RGB rows, top to bottom: [grid_height * patch, grid_width * patch, 3], uint8.
    pixels: bytes
    content_hash: bytes

    def __repr__(self) -> str:  # the pixels stay out of logs
        return f"PreparedImage({self.grid_height}x{self.grid_width} patches, {self.content_hash.hex()[:12]})"

    def to_proto(self, *, with_pixels: bool = True) -> common_pb2.ImageInput:
        """A new ``ImageInput`` (the caller sets its ``token_offset``); without pixels for a
        caller that only counts tokens."""
        return common_pb2.ImageInput(
            num_tokens=self.num_tokens,
            grid_height=self.grid_height,
            grid_width=self.grid_width,
            pixels=self.pixels if with_pixels else b"",
            content_hash=self.content_hash,
        )


def prompt_images(
    parts: Sequence[tuple[str, str]],
    vision: VisionInfo,
    limits: ImageLimits,
    cache: PreparedImageCache | None = None,
    *,
    with_pixels: bool = True,
) -> list[common_pb2.ImageInput]:
    """Each ``(field, url)`` image part of a request as an ``ImageInput``, in order, within the
    request's caps (the part that crosses one is named). Without pixels, the same images are
    accepted and refused (the pixel cap included): a count is what the request would be billed."""
    images: list[common_pb2.ImageInput] = []
    total = 0
    for number, (field, url) in enumerate(parts):
        if number == limits.max_images:
            raise _invalid(field, f"more than {limits.max_images} images in one request")
        image = prepared_image(url, field, vision, limits, cache)
        total += len(image.pixels)
        if total > limits.max_total_pixel_bytes:
            raise _invalid(
                field,
                f"the request's images come to over {limits.max_total_pixel_bytes:,} bytes of pixels "
                "at the model's resolution",
            )
        images.append(image.to_proto(with_pixels=with_pixels))
    return images


def prepared_image(
    url: str, field: str, vision: VisionInfo, limits: ImageLimits, cache: PreparedImageCache | None = None
) -> PreparedImage:
    """One image part read, decoded and resized; with a cache, decoded and resized only the
    first time its bytes are seen (a URL is fetched every time: what it names may change)."""
    data = image_bytes(url, field, limits)
    if cache is None:
        return resized_input(decode_rgb(data, field, limits), vision)
    return cache.prepared(data, vision, lambda: resized_input(decode_rgb(data, field, limits), vision))


def resized_input(image: Image.Image, vision: VisionInfo) -> PreparedImage:
    """An RGB image resized and padded to the model's patch grid."""
    (height, width), (padded_h, padded_w) = navit_size(image.height, image.width, vision)
    if (height, width) != (image.height, image.width):
        image = image.resize((width, height), Image.Resampling.BICUBIC)
    if (padded_h, padded_w) != (height, width):
        canvas = Image.new("RGB", (padded_w, padded_h), (0, 0, 0))
        canvas.paste(image, (0, 0))
        image = canvas
    pixels = image.tobytes()  # RGB rows, top to bottom: [padded_h, padded_w, 3]
    grid_h, grid_w = padded_h // vision.patch_size, padded_w // vision.patch_size
    merge_h, merge_w = vision.merge_kernel
    return PreparedImage(
        num_tokens=grid_h * grid_w // (merge_h * merge_w),
        grid_height=grid_h,
        grid_width=grid_w,
        pixels=pixels,
        content_hash=content_hash(grid_h, grid_w, pixels),
    )


def decode_rgb(data: bytes, field: str, limits: ImageLimits) -> Image.Image:
    """The encoded image as an RGB picture, checked against the pixel cap before it is decoded."""
    try:
        with warnings.catch_warnings():
            # Pillow warns of "decompression bombs" from 89M pixels; our own cap below decides.
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data), formats=FORMATS)
        if image.width * image.height > limits.max_pixels:
            raise _invalid(
                field,
                f"{image.width}x{image.height} pixels is over the limit of {limits.max_pixels:,} pixels",
            )
        image.seek(0)  # an animated GIF: its first frame
        image.load()
        return _to_rgb(ImageOps.exif_transpose(image))
    except InvalidArgument:
        raise
    except Image.UnidentifiedImageError:
        raise _invalid(field, f"not an image in a supported format ({', '.join(FORMATS)})") from None
    except Image.DecompressionBombError:
        raise _invalid(field, f"over the limit of {limits.max_pixels:,} pixels") from None
    # Pillow's decoders report corrupt or truncated data with whatever they hit (OSError,
    # SyntaxError, ValueError, struct.error, EOFError...): any of them means a bad image.
    except Exception as error:  # noqa: BLE001 - see above
        raise _invalid(field, f"the image could not be decoded ({type(error).__name__}: {error})") from None


def _to_rgb(image: Image.Image) -> Image.Image:
    if image.mode == "RGB":
        return image
    if "A" in image.getbands() or "transparency" in image.info:
        rgba = image.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    return image.convert("RGB")


def image_bytes(url: str, field: str, limits: ImageLimits) -> bytes:
    """The encoded image a URL names: a data URL's payload, or an allowed http(s) URL's body."""
    if url[:5].lower() == "data:":
        return _data_url_bytes(url, field, limits)
    if urlsplit(url).scheme.lower() in ("http", "https"):
        return _fetch(url, field, limits)
    raise _invalid(field, "expected a data:image/...;base64,... URL or an http(s) URL")


def _data_url_bytes(url: str, field: str, limits: ImageLimits) -> bytes:
    header, comma, payload = url.partition(",")
    if not comma:
        raise _invalid(field, "a data URL needs a ',' before its data")
    media_type, *parameters = header[len("data:") :].split(";")
    if not media_type.lower().startswith("image/"):
        raise _invalid(field, f"a data URL of {media_type or 'no media type'!r} is not an image")
    if "base64" not in (parameter.strip().lower() for parameter in parameters):
        raise _invalid(field, "only base64 data URLs are accepted (data:image/png;base64,...)")
    # Four characters carry three bytes: refuse an oversized payload before decoding it.
    if len(payload) > 4 * (limits.max_bytes // 3 + 1) + 64:
        raise _too_large(field, limits)
    try:
        data = base64.b64decode("".join(payload.split()), validate=True)
    except (binascii.Error, ValueError):
        raise _invalid(field, "the data URL's data is not valid base64") from None
    if len(data) > limits.max_bytes:
        raise _too_large(field, limits)
    return data


def _too_large(field: str, limits: ImageLimits) -> InvalidArgument:
    return _invalid(field, f"the image is over the limit of {limits.max_bytes:,} bytes")


def _fetch(url: str, field: str, limits: ImageLimits) -> bytes:
    """GET an allowed URL: one hop (a redirect could lead off the allow-list), at most
    ``max_bytes``, within ``fetch_timeout_seconds`` in all. Proxy settings of the environment
    are ignored (trust_env=False): the host fetched is the host that was checked."""
    host = (urlsplit(url).hostname or "").lower()
    if host not in limits.url_hosts:
        allowed = "only data: URLs are accepted" if not limits.url_hosts else "it is not on the allow-list"
        raise _invalid(field, f"image URLs of host {host!r} are not fetched here; {allowed}")
    deadline = time.monotonic() + limits.fetch_timeout_seconds
    try:
        with (
            httpx.Client(
                follow_redirects=False, timeout=limits.fetch_timeout_seconds, trust_env=False
            ) as client,
            client.stream("GET", url) as response,
        ):
            if response.is_redirect:
                raise _invalid(
                    field, f"the URL answered a redirect (HTTP {response.status_code}); none are followed"
                )
            if response.status_code != 200:
                raise _invalid(field, f"fetching the image answered HTTP {response.status_code}")
            declared = response.headers.get("content-length", "")
            if declared.isdigit() and int(declared) > limits.max_bytes:
                raise _too_large(field, limits)
            body = bytearray()
            for chunk in response.iter_bytes():
                body += chunk
                if len(body) > limits.max_bytes:
                    raise _too_large(field, limits)
                if time.monotonic() > deadline:
                    raise _invalid(field, f"fetching the image took over {limits.fetch_timeout_seconds:g} s")
            return bytes(body)
    except httpx.HTTPError as error:
        raise _invalid(field, f"fetching the image failed ({type(error).__name__})") from None
