"""KV blocks: reference counts, free lists and the hash -> block map of the prefix cache."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass


@dataclass
class KVBlock:
    block_id: int
    ref_cnt: int = 0  # requests using this block
    block_hash: bytes | None = None  # set once the block is full and cached


class BlockPool:
    """Owns every KV block.

    A free block either holds nothing worth keeping, or a cached prefix that stays findable by
    hash until the block is reused. Allocation takes blocks of the first kind first, so cached
    content is evicted only when free blocks run out, and then least recently freed first.
    """

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.enable_caching = enable_caching
        # OrderedDicts as ordered sets: O(1) removal of a cache hit from the middle
        self._free_empty: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._free_cached: OrderedDict[int, None] = OrderedDict()  # least recently freed first
        self._cached: dict[bytes, KVBlock] = {}

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self._free_empty) + len(self._free_cached)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def lookup(self, block_hash: bytes) -> KVBlock | None:
        return self._cached.get(block_hash) if self.enable_caching else None

    def allocate(self, n: int) -> list[KVBlock]:
        """Takes n free blocks, evicting cached content only when no empty block is left."""
        if n > self.num_free_blocks:
            raise RuntimeError(f"asked for {n} blocks, {self.num_free_blocks} free")
        out = []
        for _ in range(n):
            free_list = self._free_empty or self._free_cached
            block = self.blocks[free_list.popitem(last=False)[0]]
            self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Takes a reference on cache hits; a hit on a free block takes it off the free list."""
        for block in blocks:
            if block.ref_cnt == 0:
                self._free_cached.pop(block.block_id)
            block.ref_cnt += 1

    def free(self, blocks: Iterable[KVBlock]) -> None:
        """Drops a reference. Pass a request's blocks tail first: the tail of a sequence is the
        least likely to be shared, so it should be evicted first."""
        for block in blocks:
            block.ref_cnt -= 1
            if block.ref_cnt < 0:
                raise RuntimeError(f"block {block.block_id} freed twice")
            if block.ref_cnt == 0:
                free_list = self._free_cached if block.block_hash else self._free_empty
                free_list[block.block_id] = None

    def cache(self, block: KVBlock, block_hash: bytes) -> None:
        """Records a full block under its hash; an existing entry for the hash is kept."""
        if self.enable_caching and block.block_hash is None and block_hash not in self._cached:
            block.block_hash = block_hash
            self._cached[block_hash] = block

    def reset_cache(self) -> None:
        """Forgets every cached prefix (blocks in use keep their data)."""
        for block in list(self._cached.values()):
            self._evict(block)
        self._free_empty.update(self._free_cached)
        self._free_cached.clear()

    def _evict(self, block: KVBlock) -> None:
        if block.block_hash is not None:
            del self._cached[block.block_hash]
            block.block_hash = None
