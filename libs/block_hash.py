"""The prefix block hash that engine, cache index and router must agree on.

A prompt is cut into fixed blocks of ``block_size`` tokens (16 by default).
Block ``i`` is named by::

    h[i] = H(seed, h[i-1], tokens[i*B:(i+1)*B])      with h[-1] = 0

where ``seed = H(model id, cache salt)`` and H is BLAKE2b with an 8-byte digest
read as an unsigned little-endian integer (a proto ``uint64``). Because every
hash folds in its parent, equal hashes mean equal prefixes: the router can ask
"how many of these leading blocks do you hold?" without sending tokens twice.
Only full blocks are hashed; a trailing partial block has no name.

Token ids are encoded as little-endian uint32, so the hash does not depend on
the host or on how the caller stores ids. Changing anything here invalidates
every cache index: tests pin golden values.

An image's placeholder tokens are the same ids for every picture, so a block that
holds any of them also folds in the content hash of each image it overlaps (in
token order): the same screenshot in the next turn names the same blocks, a changed
pixel names others from that block on. Blocks without images hash as before.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass

DEFAULT_BLOCK_SIZE = 16
_DIGEST_BYTES = 8
_NO_PARENT = 0
_LEN_8 = struct.pack("<I", 8)


def _digest(*parts: bytes) -> int:
    hasher = hashlib.blake2b(digest_size=_DIGEST_BYTES)
    for part in parts:
        # Length-prefix each part so that ("ab", "c") and ("a", "bc") differ.
        hasher.update(struct.pack("<I", len(part)))
        hasher.update(part)
    return int.from_bytes(hasher.digest(), "little")


def hash_seed(model: str, cache_salt: str = "", *, reproducible: str = "") -> int:
    """Seed of a model's hash chain; anything that changes the KV belongs in it.
    ``reproducible``: for KV computed in batch-invariant steps (greedy and seeded requests),
    what computed it (``EngineInfo.reproducible_kernels``: the device and its kernels' builds).
    A cold run of the same request on the same kind of host computes it bit for bit; another
    kind's kernels sum in other orders, and other steps' KV may differ in its last bits, so
    none of them share blocks. Empty: KV from steps that are not batch-invariant."""
    if reproducible:
        return _digest(
            b"cachet-block-hash-v1",
            model.encode(),
            cache_salt.encode(),
            b"batch-invariant",
            reproducible.encode(),
        )
    return _digest(b"cachet-block-hash-v1", model.encode(), cache_salt.encode())


@dataclass(frozen=True)
class ImageSpan:
    """Where an image's placeholder tokens sit in a prompt, and what the image is."""

    token_offset: int
    num_tokens: int
    content_hash: bytes


def hash_block(seed: int, parent_hash: int, token_ids: Sequence[int], images: bytes = b"") -> int:
    """Hash of one full block given the hash of the block before it (0 for the first);
    ``images``: the content hashes of the images whose tokens the block holds, in order."""
    tokens = struct.pack(f"<{len(token_ids)}I", *token_ids)
    parts = [seed.to_bytes(8, "little"), parent_hash.to_bytes(8, "little"), tokens]
    if images:
        parts.append(images)
    return _digest(*parts)


def images_in_block(images: Sequence[ImageSpan], start: int, end: int) -> bytes:
    """The content hashes of the images with a token in ``[start, end)``, in token order."""
    return b"".join(
        image.content_hash
        for image in images
        if image.token_offset < end and image.token_offset + image.num_tokens > start
    )


def chain_hashes(
    seed: int,
    parent: int,
    token_ids: Sequence[int],
    *,
    block_size: int = DEFAULT_BLOCK_SIZE,
    first_block: int = 0,
    images: Sequence[ImageSpan] = (),
) -> list[int]:
    """Hashes of the full blocks of ``token_ids`` from block ``first_block`` on, chained from
    ``parent`` (the hash of the block before it; 0 for none). The router's ``block_hashes`` and
    the engine's, which extends a request's chain as its tokens fill blocks, are this one loop.

    Each block is ``hash_block``'s value, computed as one BLAKE2b call over the same bytes
    (every part length-prefixed) with the prompt packed once: 2.5x faster (8,192 tokens:
    0.47 ms, was 1.15 ms), and the router and the engine each hash every prompt."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    end_block = len(token_ids) // block_size
    if end_block <= first_block:
        return []
    start = first_block * block_size
    packed = struct.pack(
        f"<{(end_block - first_block) * block_size}I", *token_ids[start : end_block * block_size]
    )
    width = block_size * 4
    # seed's length and bytes, then the parent's length: what precedes each block's own bytes.
    head = _LEN_8 + seed.to_bytes(8, "little") + _LEN_8
    tokens_length = struct.pack("<I", width)
    hashes: list[int] = []
    for i in range(end_block - first_block):
        parts = [head, parent.to_bytes(8, "little"), tokens_length, packed[i * width : (i + 1) * width]]
        if images:
            block_start = start + i * block_size
            held = images_in_block(images, block_start, block_start + block_size)
            if held:
                parts += [struct.pack("<I", len(held)), held]
        digest = hashlib.blake2b(b"".join(parts), digest_size=_DIGEST_BYTES).digest()
        parent = int.from_bytes(digest, "little")
        hashes.append(parent)
    return hashes


def block_hashes(
    token_ids: Sequence[int],
    model: str,
    *,
    block_size: int = DEFAULT_BLOCK_SIZE,
    cache_salt: str = "",
    start_parent: int = _NO_PARENT,
    images: Sequence[ImageSpan] = (),
    reproducible: str = "",
) -> list[int]:
    """Chained hashes of every full block of ``token_ids``, block 0 first; ``images``: the
    prompt's images (their placeholder tokens are in ``token_ids``)."""
    seed = hash_seed(model, cache_salt, reproducible=reproducible)
    return chain_hashes(seed, start_parent, token_ids, block_size=block_size, images=images)
