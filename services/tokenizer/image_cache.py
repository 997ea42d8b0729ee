"""Prepared images by content: a picture sent again is not decoded and resized again.

An agent resends its whole conversation every turn, old screenshots included; decoding and
resizing one (``images.py``) costs tens of milliseconds, reading and hashing its bytes well under
one. Entries are keyed by the SHA-256 of the encoded bytes (a data URL's payload, or a fetched
body: never a URL, whose content may change) and the model's resize settings, which alone
decide the result. Least recently used out first, within ``capacity_bytes`` of pixels.

The values are ``PreparedImage``s, immutable: a request gets its own ``ImageInput`` built from
one (``PreparedImage.to_proto``), so none can change the pixels another reads.

``prepared`` is called from the servicer's worker threads: one lock guards the table, and the
preparing itself runs outside it. Two threads that miss on the same picture at once both
prepare it (the same result); the second one's entry replaces the first.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

from cachet.tokenizer.images import PreparedImage
from cachet.tokenizer.model_info import VisionInfo

DEFAULT_CAPACITY_BYTES = 256 * 1024 * 1024


class ImageKey(NamedTuple):
    """What decides a prepared image: its encoded bytes and the model's resize settings
    (``navit_size``); two models that resize alike share entries."""

    source_sha256: bytes
    patch_size: int
    merge_kernel: tuple[int, int]
    max_patches: int
    max_patches_per_side: int

    @classmethod
    def of(cls, data: bytes, vision: VisionInfo) -> ImageKey:
        return cls(
            hashlib.sha256(data).digest(),
            vision.patch_size,
            vision.merge_kernel,
            vision.max_patches,
            vision.max_patches_per_side,
        )


@dataclass(frozen=True)
class CacheFigures:
    """A consistent reading of the cache, for metrics and tests."""

    hits: int
    misses: int
    evictions: int
    entries: int
    size_bytes: int
    capacity_bytes: int


def _size(image: PreparedImage) -> int:
    return len(image.pixels) + len(image.content_hash)


class PreparedImageCache:
    """``PreparedImage``s by ``ImageKey``, least recently used first out, at most
    ``capacity_bytes`` of pixels (0: nothing is kept). An image larger than the whole capacity
    is prepared and returned but not kept."""

    def __init__(self, capacity_bytes: int = DEFAULT_CAPACITY_BYTES) -> None:
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be 0 or more, not {capacity_bytes}")
        self._capacity = capacity_bytes
        self._entries: OrderedDict[ImageKey, PreparedImage] = OrderedDict()  # oldest use first
        self._bytes = 0
        self._hits = self._misses = self._evictions = 0
        self._lock = threading.Lock()

    def prepared(
        self, data: bytes, vision: VisionInfo, prepare: Callable[[], PreparedImage]
    ) -> PreparedImage:
        """The image ``data`` encodes, at ``vision``'s resolution: the kept one, or ``prepare()``'s
        (kept for next time). ``prepare``'s errors pass through and nothing is kept."""
        key = ImageKey.of(data, vision)
        with self._lock:
            found = self._entries.get(key)
            if found is not None:
                self._entries.move_to_end(key)
                self._hits += 1
                return found
            self._misses += 1
        image = prepare()
        self._keep(key, image)
        return image

    def _keep(self, key: ImageKey, image: PreparedImage) -> None:
        size = _size(image)
        if size > self._capacity:
            return
        with self._lock:
            replaced = self._entries.pop(key, None)
            if replaced is not None:
                self._bytes -= _size(replaced)
            self._entries[key] = image
            self._bytes += size
            while self._bytes > self._capacity:
                _, dropped = self._entries.popitem(last=False)
                self._bytes -= _size(dropped)
                self._evictions += 1

    def keys_oldest_first(self) -> list[ImageKey]:
        """The keys held, least recently used first (tests, debugging)."""
        with self._lock:
            return list(self._entries)

    @property
    def figures(self) -> CacheFigures:
        with self._lock:
            return CacheFigures(
                hits=self._hits,
                misses=self._misses,
                evictions=self._evictions,
                entries=len(self._entries),
                size_bytes=self._bytes,
                capacity_bytes=self._capacity,
            )

    def check_invariants(self) -> None:
        """The byte count is the entries' sizes, within the capacity."""
        with self._lock:
            counted = sum(_size(image) for image in self._entries.values())
            assert counted == self._bytes, (counted, self._bytes)
            assert self._bytes <= self._capacity, (self._bytes, self._capacity)
