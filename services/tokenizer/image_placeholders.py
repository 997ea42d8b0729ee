"""Each image's one placeholder token in a tokenized prompt, expanded to the image's tokens.

The chat template renders an image part as the model's placeholder markup, so the tokenized
prompt holds the placeholder id once per image, in image order. Each becomes ``num_tokens``
copies (one per merged patch), and the image learns where its span starts:

    rendered:  a b P c d P e            P: the placeholder; images of 3 and 2 tokens
    expanded:  a b P P P c d P P e      token_offset 2 and 7

A cache breakpoint (``prefix_token_counts``) that ends after a placeholder moves with it, by
the tokens its image added, so it still ends where its messages end.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from cachet.common.v1 import common_pb2
from cachet.errors import InvalidArgument
from cachet.tokenizer.model_info import VisionInfo
from cachet.tokenizer.tokenizer_model import RenderedChat


def expand_placeholders(
    rendered: RenderedChat, vision: VisionInfo, images: Sequence[common_pb2.ImageInput]
) -> RenderedChat:
    """``rendered`` with each image's placeholder expanded and ``images`` (whose
    ``token_offset`` this sets) attached. Refused when the placeholders and the images do not
    pair up: a text part that spells the placeholder token would otherwise take an image's place."""
    placeholder = vision.placeholder_token_id
    positions = [index for index, token_id in enumerate(rendered.token_ids) if token_id == placeholder]
    if len(positions) != len(images):
        raise InvalidArgument(
            f"messages: the rendered prompt holds {len(positions)} image placeholders "
            f"({vision.placeholder_text}) for {len(images)} images; text may not spell the placeholder token",
            param="messages",
        )
    token_ids: list[int] = []
    start = 0
    for position, image in zip(positions, images, strict=True):
        token_ids.extend(rendered.token_ids[start:position])
        image.token_offset = len(token_ids)
        token_ids.extend([placeholder] * image.num_tokens)
        start = position + 1
    token_ids.extend(rendered.token_ids[start:])
    counts = [
        count
        + sum(
            image.num_tokens - 1
            for position, image in zip(positions, images, strict=True)
            if position < count
        )
        for count in rendered.prefix_token_counts
    ]
    return replace(rendered, token_ids=token_ids, prefix_token_counts=counts, images=list(images))
