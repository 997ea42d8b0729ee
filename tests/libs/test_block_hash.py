import random

import pytest

from cachet.block_hash import (
    DEFAULT_BLOCK_SIZE,
    ImageSpan,
    block_hashes,
    chain_hashes,
    hash_block,
    hash_seed,
    images_in_block,
)

MODEL = "smollm2-135m-instruct"


def test_golden_values() -> None:
    # Pinned: every service and every stored cache index depends on these.
    assert block_hashes(list(range(40)), MODEL) == [7906599310257278436, 9715039457657459474]
    assert block_hashes(list(range(12)), MODEL, block_size=4) == [
        495026264763325614,
        13047274819268275995,
        4176899890928161455,
    ]


def test_only_full_blocks_are_hashed() -> None:
    assert block_hashes(list(range(15)), MODEL) == []
    assert len(block_hashes(list(range(16)), MODEL)) == 1
    assert len(block_hashes(list(range(47)), MODEL)) == 2


def test_change_in_block_k_changes_every_later_hash_and_no_earlier_one() -> None:
    tokens = list(range(100, 100 + 6 * DEFAULT_BLOCK_SIZE))
    base = block_hashes(tokens, MODEL)
    for k in range(6):
        changed = list(tokens)
        changed[k * DEFAULT_BLOCK_SIZE + 3] += 1
        hashes = block_hashes(changed, MODEL)
        assert hashes[:k] == base[:k]
        assert all(a != b for a, b in zip(hashes[k:], base[k:], strict=True))


def test_seed_separates_models_and_salts() -> None:
    tokens = list(range(32))
    assert block_hashes(tokens, MODEL) != block_hashes(tokens, "other-model")
    assert block_hashes(tokens, MODEL) != block_hashes(tokens, MODEL, cache_salt="tenant-a")
    assert block_hashes(tokens, MODEL, cache_salt="a") == block_hashes(tokens, MODEL, cache_salt="a")


def test_chain_is_incremental() -> None:
    tokens = list(range(64))
    full = block_hashes(tokens, MODEL)
    seed = hash_seed(MODEL)
    parent = 0
    for i, expected in enumerate(full):
        parent = hash_block(seed, parent, tokens[i * 16 : (i + 1) * 16])
        assert parent == expected
    assert block_hashes(tokens[32:], MODEL, start_parent=full[1]) == full[2:]


def test_an_images_golden_values() -> None:
    # Pinned like the plain ones (computed with hash_block before chain_hashes packed the prompt once).
    red = ImageSpan(token_offset=20, num_tokens=16, content_hash=b"r" * 32)
    assert block_hashes([7] * 48, "m", images=[red]) == [
        3151676359135897593,
        4481191575425731490,
        11435249559094364419,
    ]


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("first_block", [0, 1, 5])
def test_chain_hashes_is_hash_block_chained(block_size: int, first_block: int) -> None:
    # The engine extends a request's chain from where it stopped; the router hashes from block 0.
    rng = random.Random(block_size * 10 + first_block)
    tokens = [rng.randrange(2**32) for _ in range(7 * block_size + 3)]
    images = [ImageSpan(2, 3 * block_size, b"a" * 32), ImageSpan(5 * block_size, 1, b"b")]
    seed = hash_seed(MODEL, "salt")
    parent, expected = 0, []
    for i in range(len(tokens) // block_size):
        start, end = i * block_size, (i + 1) * block_size
        parent = hash_block(seed, parent, tokens[start:end], images_in_block(images, start, end))
        expected.append(parent)
    start_parent = expected[first_block - 1] if first_block else 0
    got = chain_hashes(
        seed, start_parent, tokens, block_size=block_size, first_block=first_block, images=images
    )
    assert got == expected[first_block:]
    assert chain_hashes(seed, 0, tokens[: block_size - 1], block_size=block_size) == []


def test_hashes_fit_uint64() -> None:
    assert all(0 <= h < 2**64 for h in block_hashes(list(range(1000)), MODEL))


def test_block_size_must_be_positive() -> None:
    with pytest.raises(ValueError, match="block_size"):
        block_hashes([1, 2], MODEL, block_size=0)


def test_an_image_names_the_blocks_holding_its_tokens_and_every_block_after() -> None:
    # 64 tokens, block 16: the image's placeholders fill tokens 20..35 (blocks 1 and 2).
    tokens = [7] * 64
    red = ImageSpan(token_offset=20, num_tokens=16, content_hash=b"r" * 32)
    blue = ImageSpan(token_offset=20, num_tokens=16, content_hash=b"b" * 32)
    plain = block_hashes(tokens, "m")
    with_red = block_hashes(tokens, "m", images=[red])
    with_blue = block_hashes(tokens, "m", images=[blue])
    assert with_red[0] == with_blue[0] == plain[0]
    assert all(r != b for r, b in zip(with_red[1:], with_blue[1:], strict=True))
    assert all(r != p for r, p in zip(with_red[1:], plain[1:], strict=True))
    assert block_hashes(tokens, "m", images=[red]) == with_red


def test_images_in_block_takes_every_image_a_block_overlaps_in_order() -> None:
    first = ImageSpan(token_offset=0, num_tokens=10, content_hash=b"a")
    second = ImageSpan(token_offset=10, num_tokens=20, content_hash=b"b")
    assert images_in_block([first, second], 0, 16) == b"ab"
    assert images_in_block([first, second], 16, 32) == b"b"
    assert images_in_block([first, second], 32, 48) == b""


def test_batch_invariant_kv_has_a_chain_of_its_own() -> None:
    tokens = list(range(32))
    assert block_hashes(tokens, MODEL, reproducible="") == block_hashes(tokens, MODEL)
    invariant = block_hashes(tokens, MODEL, reproducible="cpu:a")
    assert set(invariant).isdisjoint(block_hashes(tokens, MODEL))
    assert hash_seed(MODEL, reproducible="cpu:a") != hash_seed(MODEL)
    # Other kernels' batch-invariant steps sum in other orders: a chain of their own too.
    assert set(invariant).isdisjoint(block_hashes(tokens, MODEL, reproducible="cpu:b"))
