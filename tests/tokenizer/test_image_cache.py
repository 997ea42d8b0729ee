"""The prepared-image cache on its own: exact keys, eviction order and byte counts, with tiny
made-up images (the service's use of it is in test_images.py)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
from metrics_scrape import naming_problems
from prometheus_client import CollectorRegistry, generate_latest

from cachet.tokenizer.image_cache import ImageKey, PreparedImageCache
from cachet.tokenizer.images import PreparedImage
from cachet.tokenizer.metrics import ImageCacheCollector
from cachet.tokenizer.model_info import VisionInfo

K25 = VisionInfo(0, "", 14, (2, 2), 16384, 512)
HASH = bytes(32)  # every made-up image's content hash: 32 bytes of its size


def made_up(pixel_bytes: int, fill: int = 0) -> PreparedImage:
    return PreparedImage(1, 1, 1, bytes([fill]) * pixel_bytes, HASH)


class Preparer:
    """``prepare`` callables that count their calls, as a decode would be counted."""

    def __init__(self) -> None:
        self.calls: list[bytes] = []

    def __call__(self, data: bytes, pixel_bytes: int = 68) -> PreparedImage:
        self.calls.append(data)
        return made_up(pixel_bytes, fill=data[0])


def get(cache: PreparedImageCache, prepare: Preparer, data: bytes, pixel_bytes: int = 68) -> PreparedImage:
    image = cache.prepared(data, K25, lambda: prepare(data, pixel_bytes))
    cache.check_invariants()
    return image


def held(cache: PreparedImageCache) -> list[bytes]:
    """The one-letter sources the cache holds, least recently used first."""
    names = {ImageKey.of(bytes([letter]), K25): bytes([letter]) for letter in b"abcdefz"}
    return [names[key] for key in cache.keys_oldest_first()]


def test_a_hit_returns_the_kept_image_and_prepares_nothing() -> None:
    cache, prepare = PreparedImageCache(1000), Preparer()
    first = get(cache, prepare, b"a")
    assert get(cache, prepare, b"a") is first
    assert prepare.calls == [b"a"]
    figures = cache.figures
    assert (figures.hits, figures.misses, figures.entries, figures.size_bytes) == (1, 1, 1, 100)


def test_the_least_recently_used_goes_first_to_stay_within_the_bytes() -> None:
    cache, prepare = PreparedImageCache(300), Preparer()  # three entries of 68 + 32 bytes
    for data in (b"a", b"b", b"c"):
        get(cache, prepare, data)
    get(cache, prepare, b"a")  # a hit: a is now the most recent
    get(cache, prepare, b"d")  # b goes
    assert held(cache) == [b"c", b"a", b"d"]
    assert cache.figures.evictions == 1 and cache.figures.size_bytes == 300
    get(cache, prepare, b"e", pixel_bytes=168)  # 200 bytes: c and a go
    assert held(cache) == [b"d", b"e"]
    assert cache.figures.evictions == 3
    get(cache, prepare, b"b")  # evicted before: prepared again
    assert prepare.calls == [b"a", b"b", b"c", b"d", b"e", b"b"]


def test_an_image_over_the_whole_capacity_is_returned_not_kept() -> None:
    cache, prepare = PreparedImageCache(300), Preparer()
    get(cache, prepare, b"a")
    huge = get(cache, prepare, b"z", pixel_bytes=1000)
    assert len(huge.pixels) == 1000 and held(cache) == [b"a"] and cache.figures.evictions == 0
    get(cache, prepare, b"z", pixel_bytes=1000)
    assert prepare.calls == [b"a", b"z", b"z"]


def test_capacity_zero_keeps_nothing() -> None:
    cache, prepare = PreparedImageCache(0), Preparer()
    get(cache, prepare, b"a")
    get(cache, prepare, b"a")
    assert prepare.calls == [b"a", b"a"] and cache.figures.entries == 0
    with pytest.raises(ValueError, match="capacity_bytes"):
        PreparedImageCache(-1)


def test_the_key_is_the_bytes_and_the_resize_settings() -> None:
    cache, prepare = PreparedImageCache(1000), Preparer()
    other_budget = VisionInfo(0, "", 14, (2, 2), 4096, 512)
    other_placeholder = VisionInfo(7, "<|media_pad|>", 14, (2, 2), 16384, 512)
    cache.prepared(b"a", K25, lambda: prepare(b"a"))
    cache.prepared(b"a", other_budget, lambda: prepare(b"a"))  # resized otherwise: a miss
    cache.prepared(b"a", other_placeholder, lambda: prepare(b"a"))  # resized alike: a hit
    assert len(prepare.calls) == 2 and cache.figures.hits == 1


def test_a_failed_prepare_keeps_nothing() -> None:
    cache = PreparedImageCache(1000)

    def bad() -> PreparedImage:
        raise ValueError("not an image")

    with pytest.raises(ValueError, match="not an image"):
        cache.prepared(b"a", K25, bad)
    assert cache.figures.entries == 0 and cache.figures.misses == 1
    cache.check_invariants()


def test_threads_share_the_cache_without_losing_count() -> None:
    cache, prepare = PreparedImageCache(500), Preparer()  # five of the eight pictures fit

    def one(number: int) -> PreparedImage:
        data = bytes([number % 8])
        return cache.prepared(data, K25, lambda: prepare(data))

    with ThreadPoolExecutor(max_workers=8) as pool:
        images = list(pool.map(one, range(2000)))
    cache.check_invariants()
    assert all(image.pixels == bytes([number % 8]) * 68 for number, image in enumerate(images))
    figures = cache.figures
    assert figures.hits + figures.misses == 2000 and figures.misses == len(prepare.calls)
    assert figures.entries == 5 and figures.size_bytes == 500


def test_the_collector_reports_hits_and_misses_in_prometheus_names() -> None:
    cache, prepare = PreparedImageCache(1000), Preparer()
    get(cache, prepare, b"a")
    get(cache, prepare, b"a")
    registry = CollectorRegistry()
    registry.register(ImageCacheCollector(cache))
    text = generate_latest(registry).decode()
    assert naming_problems(text) == []
    assert "cachet_tokenizer_image_cache_hits_total 1.0" in text
    assert "cachet_tokenizer_image_cache_misses_total 1.0" in text
    assert "cachet_tokenizer_image_cache_bytes 100.0" in text
    assert "cachet_tokenizer_image_cache_capacity_bytes 1000.0" in text
