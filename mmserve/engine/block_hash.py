"""Chained, cryptographic hashes of full KV blocks for automatic prefix caching.

hash(block i) = sha256(hash(block i-1) || token ids || extra keys). Chaining makes a block's
hash stand for its whole prefix; sha256 makes a collision between tenants infeasible to craft.
Extra keys carry what the token ids alone do not say: image content hashes with the offset of
the image inside the block (two images that expand to the same placeholder tokens must never
share KV), and the request's cache_salt (mixed into the first block, so it reaches every block).
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

from mmserve.inputs import MMPlaceholder

ROOT_HASH = b"mmserve-v1"  # parent of the first block; bump when the KV layout changes


def hash_block(parent: bytes, token_ids: Sequence[int], extra_keys: Sequence[str] = ()) -> bytes:
    h = hashlib.sha256(parent)
    h.update(struct.pack(f"<{len(token_ids)}I", *token_ids))
    for key in extra_keys:
        data = key.encode()
        h.update(struct.pack("<I", len(data)))  # length-prefixed: keys cannot run together
        h.update(data)
    return h.digest()


def block_extra_keys(
    block_index: int,
    block_size: int,
    placeholders: Sequence[MMPlaceholder] = (),
    cache_salt: str | None = None,
) -> list[str]:
    """The extra keys of one block: salt on block 0; each image overlapping the block, with
    the image's offset relative to the block start (so a shifted image is a different key)."""
    start, end = block_index * block_size, (block_index + 1) * block_size
    keys = [f"salt:{cache_salt}"] if cache_salt and block_index == 0 else []
    for ph in placeholders:
        if ph.offset < end and ph.offset + ph.length > start:
            keys.append(f"mm:{ph.content_hash}:{ph.offset - start}")
    return keys


def extend_block_hashes(
    block_hashes: list[bytes],
    token_ids: Sequence[int],
    block_size: int,
    placeholders: Sequence[MMPlaceholder] = (),
    cache_salt: str | None = None,
) -> None:
    """Appends the hashes of every full block of token_ids not hashed yet."""
    for i in range(len(block_hashes), len(token_ids) // block_size):
        parent = block_hashes[-1] if block_hashes else ROOT_HASH
        tokens = token_ids[i * block_size : (i + 1) * block_size]
        extra = block_extra_keys(i, block_size, placeholders, cache_salt)
        block_hashes.append(hash_block(parent, tokens, extra))
