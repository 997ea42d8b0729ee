"""A prompt's images as the engine holds them, and the checks that keep a bad one out of a step.

The tokenizer service decodes and resizes each image and writes its placeholder tokens into
the prompt (one per merged patch); the engine receives the resized pixels beside the ids. An
image that does not fit what the model's vision tower reads would fail the step every request
shares, so it is refused here, naming the field, before it is queued.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from cachet.block_hash import ImageSpan
from cachet.common.v1 import common_pb2
from cachet.engine.errors import InvalidRequest

_RGB = 3
# SHA-256: the tokenizer service's content hash.
_CONTENT_HASH_BYTES = 32


@dataclass(frozen=True)
class ImageInputSpec:
    """What a model with a vision tower reads: its placeholder token and patch geometry."""

    placeholder_token_id: int
    patch_size: int
    merge_kernel: tuple[int, int]

    def tokens_for(self, grid_height: int, grid_width: int) -> int:
        merge_h, merge_w = self.merge_kernel
        return (grid_height // merge_h) * (grid_width // merge_w)


@dataclass(frozen=True, eq=False)
class PromptImage:
    """One image: where its placeholder tokens are, and its resized pixels (uint8 RGB rows)."""

    token_offset: int
    num_tokens: int
    grid_height: int
    grid_width: int
    pixels: bytes
    content_hash: bytes

    @property
    def span(self) -> ImageSpan:
        return ImageSpan(self.token_offset, self.num_tokens, self.content_hash)

    @property
    def end(self) -> int:
        return self.token_offset + self.num_tokens

    def __repr__(self) -> str:
        return (
            f"PromptImage(tokens [{self.token_offset}, {self.end}), grid {self.grid_height}x"
            f"{self.grid_width}, {self.content_hash[:6].hex()})"
        )


def prompt_images(
    images: Sequence[common_pb2.ImageInput], prompt_token_ids: Sequence[int], spec: ImageInputSpec | None
) -> tuple[PromptImage, ...]:
    """The request's images, checked against the prompt and the model; InvalidRequest naming the
    first field that does not fit."""
    if not images:
        return ()
    if spec is None:
        raise InvalidRequest("images: this model has no vision encoder")
    checked: list[PromptImage] = []
    previous_end = 0
    for index, image in enumerate(images):
        field = f"images[{index}]"
        merge_h, merge_w = spec.merge_kernel
        if image.grid_height < merge_h or image.grid_width < merge_w:
            raise InvalidRequest(
                f"{field}: a grid of {image.grid_height}x{image.grid_width} patches is empty"
            )
        if image.grid_height % merge_h or image.grid_width % merge_w:
            raise InvalidRequest(
                f"{field}: a grid of {image.grid_height}x{image.grid_width} patches does not divide into "
                f"{merge_h}x{merge_w} merges"
            )
        expected_tokens = spec.tokens_for(image.grid_height, image.grid_width)
        if image.num_tokens != expected_tokens:
            raise InvalidRequest(
                f"{field}.num_tokens={image.num_tokens}, but a {image.grid_height}x{image.grid_width} grid "
                f"has {expected_tokens}"
            )
        height, width = image.grid_height * spec.patch_size, image.grid_width * spec.patch_size
        if len(image.pixels) != height * width * _RGB:
            raise InvalidRequest(
                f"{field}.pixels: {len(image.pixels)} bytes, but {height}x{width} RGB pixels are "
                f"{height * width * _RGB}"
            )
        if len(image.content_hash) != _CONTENT_HASH_BYTES:
            raise InvalidRequest(f"{field}.content_hash: {len(image.content_hash)} bytes, want 32 (SHA-256)")
        end = image.token_offset + image.num_tokens
        if image.token_offset < previous_end or end > len(prompt_token_ids):
            raise InvalidRequest(
                f"{field}: tokens [{image.token_offset}, {end}) overlap the image before it or pass the "
                f"{len(prompt_token_ids)}-token prompt"
            )
        placeholders = prompt_token_ids[image.token_offset : end]
        if any(token != spec.placeholder_token_id for token in placeholders):
            raise InvalidRequest(
                f"{field}: prompt tokens [{image.token_offset}, {end}) are not all the image placeholder "
                f"{spec.placeholder_token_id}"
            )
        checked.append(
            PromptImage(
                image.token_offset,
                image.num_tokens,
                image.grid_height,
                image.grid_width,
                image.pixels,
                image.content_hash,
            )
        )
        previous_end = end
    return tuple(checked)
