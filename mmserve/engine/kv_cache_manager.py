"""Per-request KV blocks: prefix-cache lookups and slot allocation, on top of the block pool."""

from __future__ import annotations

from mmserve.engine.block_hash import extend_block_hashes
from mmserve.engine.block_pool import BlockPool, KVBlock
from mmserve.request import Request


class KVCacheManager:
    """Maps requests to their KV blocks. Block i of a request holds the KV of its tokens
    [i * block_size, (i + 1) * block_size). With num_blocks 0 (an encoder, which keeps no
    KV) every allocation succeeds and requests hold no blocks."""

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        self.block_size = block_size
        self.enabled = num_blocks > 0
        self.pool = BlockPool(max(num_blocks, 1), enable_caching and self.enabled)
        self._blocks: dict[str, list[KVBlock]] = {}
        self._block_ids: dict[str, list[int]] = {}  # the ids of _blocks, kept in step with it
        # blocks a request held before its latest allocation: the ids that one left unchanged
        self._num_kept: dict[str, int] = {}
        self._num_cached: dict[str, int] = {}  # how many leading blocks are already in the cache

    @property
    def num_blocks(self) -> int:
        """Blocks of KV cache this model has (0 for a model that keeps none)."""
        return self.pool.num_blocks if self.enabled else 0

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def block_ids(self, request_id: str) -> list[int]:
        return list(self._block_ids.get(request_id, ()))

    def num_kept_blocks(self, request_id: str) -> int:
        """How many leading block ids the latest allocate_slots left as they were (all of the
        request's blocks before it; 0 for its first allocation since admission)."""
        return self._num_kept.get(request_id, 0)

    def looks_up(self, request: Request) -> bool:
        """Whether get_computed_blocks searches the prefix cache for this request: prompt
        logprobs and pooling need every prompt position computed, so they never hit."""
        return self.pool.enable_caching and not request.params.prompt_logprobs and not request.pooling

    def get_computed_blocks(self, request: Request) -> tuple[list[KVBlock], int]:
        """The longest cached prefix of the request, in whole blocks, always leaving at least
        one token to compute (the step that computes it samples the next token)."""
        if not self.looks_up(request):
            return [], 0
        self._hash(request, request.num_tokens)
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVBlock] = []
        for block_hash in request.block_hashes[:max_blocks]:
            block = self.pool.lookup(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def allocate_slots(
        self, request: Request, num_new_tokens: int, new_computed: list[KVBlock] | None = None
    ) -> bool:
        """Makes room for num_new_tokens more tokens after the computed ones (counting the
        cache hits in new_computed). Returns False, changing nothing, when blocks run out."""
        if not self.enabled:
            return True
        new_computed = new_computed or []
        blocks = self._blocks.get(request.request_id)
        if blocks is None:
            blocks = self._blocks[request.request_id] = []
            self._block_ids[request.request_id] = []
        num_tokens = request.num_computed_tokens + len(new_computed) * self.block_size
        num_tokens += num_new_tokens
        num_needed = -(-num_tokens // self.block_size) - len(blocks) - len(new_computed)
        num_free = self.pool.num_free_blocks
        if new_computed:  # a hit on a free block takes that block off the free list too
            num_free -= sum(1 for b in new_computed if b.ref_cnt == 0)
        if num_needed > num_free:
            return False
        self._num_kept[request.request_id] = len(blocks)
        if new_computed:
            self.pool.touch(new_computed)
            self._append(request.request_id, new_computed)
        if num_needed > 0:
            self._append(request.request_id, self.pool.allocate(num_needed))
        self._cache_full_blocks(request, num_tokens)
        return True

    def trim(self, request: Request, num_tokens: int) -> None:
        """Frees the request's blocks past those num_tokens tokens need (speculative decoding:
        the blocks of refused guesses, which are never hashed into the prefix cache)."""
        blocks = self._blocks.get(request.request_id)
        keep = -(-num_tokens // self.block_size)
        if blocks is None or len(blocks) <= keep:
            return
        extra = blocks[keep:]
        del blocks[keep:]
        del self._block_ids[request.request_id][keep:]
        self._num_kept[request.request_id] = min(self._num_kept.get(request.request_id, 0), keep)
        self.pool.free(reversed(extra))

    def _append(self, request_id: str, blocks: list[KVBlock]) -> None:
        self._blocks[request_id] += blocks
        self._block_ids[request_id] += [b.block_id for b in blocks]

    def free(self, request: Request) -> None:
        """Returns the request's blocks, caching first the full ones whose tokens became known
        after their step was scheduled (async scheduling: a step in flight computes them)."""
        if request.request_id in self._blocks:
            self._cache_full_blocks(request, request.num_computed_tokens)
        blocks = self._blocks.pop(request.request_id, [])
        self._block_ids.pop(request.request_id, None)
        self._num_kept.pop(request.request_id, None)
        self._num_cached.pop(request.request_id, None)
        self.pool.free(reversed(blocks))

    def _cache_full_blocks(self, request: Request, num_tokens: int) -> None:
        """Caches the blocks that the scheduled tokens fill. Their KV is written by this step;
        a later request can only be scheduled against them after it (steps run in order on
        the device, so a step in flight is no exception). A pooling input's blocks are never
        cached: it never looks the cache up (looks_up), and it carries no tenant's cache_salt,
        so a generation of another tenant could otherwise hit (and time) its text."""
        if not self.pool.enable_caching or request.pooling:
            return
        # a block holding a pending token (its value still on the device) waits for a later step
        num_full = min(num_tokens, request.num_known_tokens) // self.block_size
        start = self._num_cached.get(request.request_id, 0)
        if num_full <= start:
            return
        self._hash(request, num_full * self.block_size)
        blocks = self._blocks[request.request_id]
        for i in range(start, num_full):
            self.pool.cache(blocks[i], request.block_hashes[i])
        self._num_cached[request.request_id] = num_full

    def _hash(self, request: Request, num_tokens: int) -> None:
        if len(request.block_hashes) < num_tokens // self.block_size:
            extend_block_hashes(
                request.block_hashes,
                request.token_ids_range(0, num_tokens),
                self.block_size,
                request.mm_placeholders,
                request.cache_salt,
            )
