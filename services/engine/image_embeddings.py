"""What a step's image placeholder tokens embed to: the vision tower's output, once per image.

A prompt chunk that holds an image's placeholder tokens takes the tower's rows for them in
place of the token embedding (``DecoderModel.forward``). An image's tokens can span several
chunks, and a later turn of the conversation resends the same picture, so the tower's output
is kept by the image's content hash (least recently used out first, within a byte budget):
the tower runs once per picture, not once per chunk.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from cachet.engine.prompt_images import PromptImage

# The default model's pictures cost ~1 MB of output each; Kimi K2.5's (7,168 wide, bf16) ~14 MB
# for a 1,000-token screenshot.
DEFAULT_CACHE_BYTES = 512 * 1024**2


class VisionTower(Protocol):
    def encode_image(self, patches: torch.Tensor, grid_h: int, grid_w: int) -> torch.Tensor: ...


class PatchNormalizer(Protocol):
    def __call__(self, pixels: torch.Tensor, patch_size: int) -> torch.Tensor: ...


@dataclass(frozen=True)
class ImageEmbeddings:
    """Rows of the step's flat token axis that hold image placeholders, and what they embed to."""

    token_index: torch.Tensor  # [n] int64
    values: torch.Tensor  # [n, hidden]


@dataclass(frozen=True)
class ScheduledSpan:
    """One request's part of the step: tokens ``[start, end)`` of it land at ``step_offset``."""

    step_offset: int
    start: int
    end: int
    images: Sequence[PromptImage]


class ImageEncoder:
    """The vision tower behind a cache of its outputs by content hash."""

    def __init__(
        self,
        tower: VisionTower,
        normalize: PatchNormalizer,
        patch_size: int,
        device: torch.device,
        cache_bytes: int = DEFAULT_CACHE_BYTES,
    ) -> None:
        self._tower = tower
        self._normalize = normalize
        self._patch_size = patch_size
        self._device = device
        self._cache_bytes = cache_bytes
        self._cached: OrderedDict[bytes, torch.Tensor] = OrderedDict()
        self._bytes = 0
        self.images_encoded = 0

    def embeddings(self, image: PromptImage) -> torch.Tensor:
        """[num_tokens, hidden]: the tower's output for ``image``, in its placeholder order."""
        cached = self._cached.get(image.content_hash)
        if cached is not None:
            self._cached.move_to_end(image.content_hash)
            return cached
        height, width = image.grid_height * self._patch_size, image.grid_width * self._patch_size
        pixels = torch.frombuffer(bytearray(image.pixels), dtype=torch.uint8).view(height, width, 3)
        with torch.inference_mode():
            patches = self._normalize(pixels, self._patch_size).to(self._device)
            encoded = self._tower.encode_image(patches, image.grid_height, image.grid_width)
        if encoded.shape[0] != image.num_tokens:
            raise ValueError(
                f"the vision tower gave {encoded.shape[0]} rows for an image of {image.num_tokens} tokens"
            )
        self.images_encoded += 1
        self._remember(image.content_hash, encoded)
        return encoded

    def step_rows(self, spans: Sequence[ScheduledSpan]) -> ImageEmbeddings | None:
        """The rows of a step's image tokens; None when the step holds none."""
        index: list[int] = []
        values: list[torch.Tensor] = []
        for span in spans:
            for image in span.images:
                first, last = max(span.start, image.token_offset), min(span.end, image.end)
                if first >= last:
                    continue
                rows = self.embeddings(image)[first - image.token_offset : last - image.token_offset]
                values.append(rows)
                index.extend(
                    range(span.step_offset + first - span.start, span.step_offset + last - span.start)
                )
        if not index:
            return None
        return ImageEmbeddings(
            token_index=torch.tensor(index, dtype=torch.int64, device=self._device),
            values=torch.cat(values),
        )

    def _remember(self, content_hash: bytes, encoded: torch.Tensor) -> None:
        size = encoded.numel() * encoded.element_size()
        if size > self._cache_bytes:
            return
        self._cached[content_hash] = encoded
        self._bytes += size
        while self._bytes > self._cache_bytes:
            _, dropped = self._cached.popitem(last=False)
            self._bytes -= dropped.numel() * dropped.element_size()
