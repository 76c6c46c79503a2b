from __future__ import annotations

import pytest

from mmserve.engine.block_hash import ROOT_HASH, MMPlaceholder, extend_block_hashes, hash_block
from mmserve.engine.block_pool import BlockPool


def test_hash_is_chained_and_keyed() -> None:
    a = hash_block(ROOT_HASH, [1, 2, 3, 4])
    assert a == hash_block(ROOT_HASH, [1, 2, 3, 4])
    assert a != hash_block(ROOT_HASH, [1, 2, 3, 5])
    assert hash_block(a, [5]) != hash_block(hash_block(ROOT_HASH, [9, 9, 9, 9]), [5])
    assert hash_block(ROOT_HASH, [1], ["ab", "c"]) != hash_block(ROOT_HASH, [1], ["a", "bc"])
    assert len(a) == 32  # sha256


def test_extend_hashes_only_full_blocks_and_extra_keys() -> None:
    hashes: list[bytes] = []
    extend_block_hashes(hashes, list(range(10)), 4)
    assert len(hashes) == 2
    salted: list[bytes] = []
    extend_block_hashes(salted, list(range(10)), 4, cache_salt="t1")
    assert salted[0] != hashes[0] and salted[1] != hashes[1]  # the salt reaches every block
    img_a = [MMPlaceholder("aaa", 2, 4)]
    img_b = [MMPlaceholder("bbb", 2, 4)]
    ha: list[bytes] = []
    hb: list[bytes] = []
    extend_block_hashes(ha, [0] * 12, 4, img_a)
    extend_block_hashes(hb, [0] * 12, 4, img_b)
    assert ha[0] != hb[0] and ha[1] != hb[1]
    # the block after the image still differs (chained) though it has no image tokens
    assert ha[2] != hb[2]


def test_pool_refcounts_and_lru_eviction() -> None:
    pool = BlockPool(4)
    a, b = pool.allocate(2)
    pool.cache(a, b"ha")
    pool.cache(b, b"hb")
    pool.free([b, a])  # tail first
    assert pool.num_free_blocks == 4 and pool.num_cached_blocks == 2
    # empty blocks are used before cached ones
    c, d = pool.allocate(2)
    assert {c.block_id, d.block_id}.isdisjoint({a.block_id, b.block_id})
    assert pool.num_cached_blocks == 2
    # then cached blocks go, least recently freed first (b was freed first)
    (e,) = pool.allocate(1)
    assert e is b and pool.lookup(b"hb") is None and pool.lookup(b"ha") is a
    # a hit on a free cached block takes it off the free list
    pool.touch([a])
    assert a.ref_cnt == 1 and pool.num_free_blocks == 0
    with pytest.raises(RuntimeError):
        pool.allocate(1)
    pool.free([a, c, d, e])
    assert pool.num_free_blocks == 4
    with pytest.raises(RuntimeError):
        pool.free([a])


def test_caching_disabled() -> None:
    pool = BlockPool(2, enable_caching=False)
    (a,) = pool.allocate(1)
    pool.cache(a, b"h")
    assert pool.lookup(b"h") is None
