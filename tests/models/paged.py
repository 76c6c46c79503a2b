"""A minimal stand-in for the model runner: a small paged KV cache, hand-built
AttentionMetadata, and one flat-batch step over several sequences."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from mmserve.attention import AttentionMetadata


@dataclass
class PagedSeq:
    """One sequence's cache state."""

    blocks: list[int] = field(default_factory=list)  # KV block ids, in order
    num_computed: int = 0  # tokens already in the cache


class PagedKV:
    """Per-layer caches [2, num_blocks, block_size, Hkv, D], filled with noise so that a read of
    an unwritten slot shows; blocks are handed out in a shuffled order (non-contiguous tables)."""

    def __init__(self, model: Any, num_blocks: int = 32, block_size: int = 4, seed: int = 0):
        gen = torch.Generator().manual_seed(seed)
        param = next(model.parameters())
        shape = (2, num_blocks, block_size, model.num_kv_heads, model.head_dim)
        self.caches = [
            torch.randn(shape, generator=gen).to(param.device, param.dtype)
            for _ in range(model.num_layers)
        ]
        self.block_size = block_size
        self.free = torch.randperm(num_blocks, generator=gen).tolist()

    def step(
        self,
        model: Any,
        batch: list[tuple[PagedSeq, list[int]]],
        embeds: torch.Tensor | None = None,  # [total new tokens, hidden]: inputs_embeds
    ) -> torch.Tensor:
        """Runs every (sequence, new token ids) pair as one flat batch; returns fp32 logits
        [total new tokens, vocab] in batch order."""
        return model.compute_logits(self.hidden(model, batch, embeds))

    def hidden(
        self,
        model: Any,
        batch: list[tuple[PagedSeq, list[int]]],
        embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """step() without the LM head: the final hidden states [total new tokens, hidden]."""
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        for seq, new in batch:
            start = seq.num_computed
            seq.num_computed += len(new)
            while len(seq.blocks) * self.block_size < seq.num_computed:
                seq.blocks.append(self.free.pop())
            ids += new
            positions += range(start, seq.num_computed)
            slots += [self._slot(seq, p) for p in range(start, seq.num_computed)]
        meta = self._metadata([s for s, _ in batch], [len(n) for _, n in batch], slots)
        device = self.caches[0].device
        extra = {} if embeds is None else {"inputs_embeds": embeds}
        hidden: torch.Tensor = model.forward(
            torch.tensor(ids, device=device),
            torch.tensor(positions, device=device),
            self.caches,
            meta,
            **extra,
        )
        return hidden

    def _slot(self, seq: PagedSeq, position: int) -> int:
        return (
            seq.blocks[position // self.block_size] * self.block_size + position % self.block_size
        )

    def _metadata(
        self, seqs: list[PagedSeq], query_lens: list[int], slots: list[int]
    ) -> AttentionMetadata:
        device = self.caches[0].device
        seq_lens = [s.num_computed for s in seqs]
        width = max(len(s.blocks) for s in seqs)
        tables = [s.blocks + [0] * (width - len(s.blocks)) for s in seqs]
        starts = [0]
        for q in query_lens:
            starts.append(starts[-1] + q)
        return AttentionMetadata(
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
            block_tables=torch.tensor(tables, dtype=torch.int32, device=device),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
            max_query_len=max(query_lens),
            max_seq_len=max(seq_lens),
            query_lens_cpu=query_lens,
            seq_lens_cpu=seq_lens,
        )
