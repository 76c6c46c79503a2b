"""The attention backend interface and its lazy registry."""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import ClassVar

import torch


@dataclass
class AttentionMetadata:
    """Describes one flat batch: the new tokens of every scheduled request, back to back.

    Request i owns the rows query_start_loc[i]:query_start_loc[i+1] of the batch; those tokens
    sit at the last query_len positions of its seq_len-long context.
    """

    query_start_loc: torch.Tensor  # [num_reqs + 1] int32, prefix sums of query lengths
    seq_lens: torch.Tensor  # [num_reqs] int32, context length after this step (cached + new)
    block_tables: torch.Tensor  # [num_reqs, max_blocks] int32, KV block ids, padded with 0
    slot_mapping: torch.Tensor  # [num_tokens] int64, cache slot of each new token; -1 = skip
    max_query_len: int  # longest query in the batch
    max_seq_len: int  # longest context in the batch
    query_lens_cpu: list[int]  # host copy of the query lengths (the reference path loops on it)
    seq_lens_cpu: list[int]  # host copy of seq_lens
    causal: bool = True  # False for encoders (bidirectional, no KV cache kept)
    # the requests a KV split count weighs (None: every one): a CUDA graph's padded step holds
    # up to its size in empty requests, which do no work, so its graphs weigh one
    busy_reqs: int | None = None
    # tensors a backend derives from the above once per step and reuses in every layer
    derived: dict[str, tuple[torch.Tensor, ...]] = field(default_factory=dict, repr=False, compare=False)

    @property
    def num_reqs(self) -> int:
        return len(self.seq_lens_cpu)


class AttentionBackend(ABC):
    """Writes new K/V into the paged cache, then attends over each request's context.

    Contract:
      q: [num_tokens, num_heads, head_dim]; k, v: [num_tokens, num_kv_heads, head_dim]
      kv_cache: [2, num_blocks, block_size, num_kv_heads, head_dim] (K then V), or None for an
        encoder step, which attends only within each request's own new tokens. In q's dtype,
        or FP8 (float8_e4m3fn) with kv_scales, K's and V's per-tensor scales (mmserve.kernels
        .paged_ref says how values are stored).
      returns [num_tokens, num_heads, head_dim] in q's dtype.
    num_heads must be a multiple of num_kv_heads (GQA). A query at position p attends to keys at
    positions <= p (causal), and with a sliding window w only to keys at positions > p - w.

    A backend with supports_forward_cached also offers forward_cached(): the same attention
    for a step whose new K/V the caller has already written into kv_cache (the model's fused
    rotary-and-cache kernel), so forward() would write them twice.
    """

    supports_forward_cached: ClassVar[bool] = False

    @abstractmethod
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
    ) -> torch.Tensor: ...

    def forward_cached(
        self,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        sliding_window: int | None = None,
        kv_scales: tuple[float, float] = (1.0, 1.0),
    ) -> torch.Tensor:
        """forward() without the cache write; only where supports_forward_cached."""
        raise NotImplementedError(f"{type(self).__name__} has no forward_cached")


_BACKENDS: dict[str, tuple[str, str]] = {
    "torch": ("mmserve.attention.torch_ref", "TorchAttentionBackend"),
    "triton": ("mmserve.attention.triton_backend", "TritonAttentionBackend"),
}


def get_attention_backend(name: str) -> AttentionBackend:
    """Instantiates a backend by name; an unknown name lists the valid ones."""
    if name not in _BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose one of {sorted(_BACKENDS)}")
    module, cls = _BACKENDS[name]
    backend: AttentionBackend = getattr(importlib.import_module(module), cls)()
    return backend
