"""The engine's checks on a request's images: whatever does not fit the vision tower is refused
with the field named, before it can fail a step every request shares."""

from __future__ import annotations

import hashlib
import re

import pytest

from cachet.common.v1 import common_pb2
from cachet.engine.errors import InvalidRequest
from cachet.engine.prompt_images import ImageInputSpec, prompt_images

PAD = 9
SPEC = ImageInputSpec(placeholder_token_id=PAD, patch_size=14, merge_kernel=(2, 2))


def image(offset: int, grid_h: int = 4, grid_w: int = 6, **overrides: object) -> common_pb2.ImageInput:
    pixels = bytes(grid_h * 14 * grid_w * 14 * 3)
    fields: dict[str, object] = {
        "token_offset": offset,
        "num_tokens": grid_h * grid_w // 4,
        "grid_height": grid_h,
        "grid_width": grid_w,
        "pixels": pixels,
        "content_hash": hashlib.sha256(pixels).digest(),
    }
    fields.update(overrides)
    return common_pb2.ImageInput(**fields)  # type: ignore[arg-type]


def prompt_with(*spans: tuple[int, int], length: int = 40) -> list[int]:
    ids = [1] * length
    for start, count in spans:
        ids[start : start + count] = [PAD] * count
    return ids


def test_images_that_fit_become_prompt_images_in_order() -> None:
    ids = prompt_with((2, 6), (10, 4))
    images = prompt_images([image(2), image(10, grid_h=4, grid_w=4)], ids, SPEC)
    assert [(i.token_offset, i.end) for i in images] == [(2, 8), (10, 14)]
    assert images[0].span.content_hash == images[0].content_hash


def test_no_images_need_no_vision_tower() -> None:
    assert prompt_images([], [1, 2, 3], None) == ()


@pytest.mark.parametrize(
    ("images", "ids", "spec", "message"),
    [
        ([image(2)], prompt_with((2, 6)), None, "images: this model has no vision encoder"),
        ([image(2, num_tokens=5)], prompt_with((2, 6)), SPEC, "images[0].num_tokens=5"),
        ([image(2, grid_h=3, num_tokens=4)], prompt_with((2, 6)), SPEC, "does not divide into 2x2"),
        ([image(2, grid_h=0, num_tokens=0)], prompt_with((2, 6)), SPEC, "is empty"),
        ([image(2, pixels=b"\0" * 10)], prompt_with((2, 6)), SPEC, "images[0].pixels: 10 bytes"),
        ([image(2, content_hash=b"short")], prompt_with((2, 6)), SPEC, "images[0].content_hash"),
        ([image(36)], prompt_with(length=40), SPEC, "pass the 40-token prompt"),
        ([image(2), image(4)], prompt_with((2, 8)), SPEC, "images[1]: tokens [4, 10) overlap"),
        ([image(3)], prompt_with((2, 6)), SPEC, "are not all the image placeholder 9"),
    ],
)
def test_an_image_that_does_not_fit_is_refused_naming_its_field(
    images: list[common_pb2.ImageInput], ids: list[int], spec: ImageInputSpec | None, message: str
) -> None:
    with pytest.raises(InvalidRequest, match=re.escape(message)):
        prompt_images(images, ids, spec)
