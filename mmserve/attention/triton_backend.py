"""The GPU attention backend: the Triton cache write, then one paged-attention launch for the
whole mixed batch (prefill chunks and decodes together)."""

from __future__ import annotations

import torch

from mmserve.attention.backend import AttentionBackend, AttentionMetadata
from mmserve.kernels.paged_attention import paged_attention
from mmserve.kernels.reshape_and_cache import reshape_and_cache


class TritonAttentionBackend(AttentionBackend):
    """Runs on CUDA (or under TRITON_INTERPRET=1 for tests). Shapes the kernels do not support
    (head_dim > 256, more than 128 query heads per KV head, a KV cache dtype other than q's or
    FP8) raise ValueError; there is no fallback to the torch path.

    Encoder steps (kv_cache None) keep no cache: the same kernel attends over the step's own
    K/V, viewed as a cache of one-token blocks whose block table for request r is its own rows
    query_start_loc[r]:query_start_loc[r + 1]. Nothing is copied unless k and v have different
    strides.
    """

    supports_forward_cached = True

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor | None,
        meta: AttentionMetadata,
        scale: float,
        sliding_window: int | None = None,
        kv_scales: tuple[float, float] = (1.0, 1.0),
    ) -> torch.Tensor:
        if kv_cache is None:
            return self._attend_own_tokens(q, k, v, meta, scale, sliding_window)
        reshape_and_cache(k, v, kv_cache, meta.slot_mapping, kv_scales)
        return self.forward_cached(q, kv_cache, meta, scale, sliding_window, kv_scales)

    def forward_cached(
        self,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        sliding_window: int | None = None,
        kv_scales: tuple[float, float] = (1.0, 1.0),
    ) -> torch.Tensor:
        """forward() for a step whose K/V are in kv_cache already (written by the model's
        fused rotary-and-cache kernel): the paged attention alone."""
        return paged_attention(
            q,
            kv_cache[0],
            kv_cache[1],
            meta.query_start_loc,
            meta.seq_lens,
            meta.block_tables,
            max_query_len=meta.max_query_len,
            max_seq_len=meta.max_seq_len,
            scale=scale,
            causal=meta.causal,
            sliding_window=sliding_window,
            kv_scales=kv_scales,
            busy_reqs=meta.busy_reqs,
        )

    @staticmethod
    def _attend_own_tokens(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        sliding_window: int | None,
    ) -> torch.Tensor:
        if k.stride() != v.stride():
            k, v = k.contiguous(), v.contiguous()
        starts = meta.query_start_loc
        own = meta.derived.get("own_tokens")
        if own is None:  # the same for every layer: computed by the first
            query_lens = starts[1:] - starts[:-1]  # each request's context is its own tokens
            offsets = torch.arange(meta.max_query_len, dtype=starts.dtype, device=starts.device)
            block_tables = starts[:-1, None] + offsets  # [num_reqs, max_query_len] token rows
            own = meta.derived["own_tokens"] = (query_lens, block_tables)
        query_lens, block_tables = own
        return paged_attention(
            q,
            k.unsqueeze(1),
            v.unsqueeze(1),
            starts,
            query_lens,
            block_tables,
            max_query_len=meta.max_query_len,
            max_seq_len=meta.max_query_len,
            scale=scale,
            causal=meta.causal,
            sliding_window=sliding_window,
        )
