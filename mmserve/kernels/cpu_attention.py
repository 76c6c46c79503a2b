"""Decode attention over the paged KV cache on the CPU by the C library (mmserve.kernels.cpu_lib;
mmserve/kernels/cpu/paged_decode.c): each decoding request's query against its context where
it lies in the cache blocks, in float32, with no gathered copy of K and V. The torch path
(mmserve.attention.torch_ref.decode_attention) gathers the contexts and pads them for one
scaled_dot_product_attention; its reference is mmserve.kernels.paged_ref.attend()."""

from __future__ import annotations

import ctypes

import torch

from mmserve.kernels import cpu_layers
from mmserve.kernels.cpu_lib import require


def supports(q: torch.Tensor, kv_cache: torch.Tensor) -> bool:
    """The library is here and both are float32 CPU tensors, the cache contiguous."""
    return cpu_layers.supports(q, kv_cache) and kv_cache.is_contiguous()


def paged_decode_cpu(
    q: torch.Tensor,  # [R, H, D]: one query per decoding request, at position seq_len - 1
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, Hkv, D]
    tables: torch.Tensor,  # [R, max_blocks] int32: each request's blocks
    seq_lens: torch.Tensor,  # [R] int64
    scale: float,
    sliding_window: int | None,
    lib: ctypes.CDLL | None = None,
) -> torch.Tensor:
    """Returns [R, H, D] float32: attend() for each request's one query. lib: another build of
    the library (tests), else this machine's."""
    reqs, heads, dim = q.shape
    _, num_blocks, block_size, kv_heads, cache_dim = kv_cache.shape
    if cache_dim != dim or heads % kv_heads or tables.shape[0] != reqs or seq_lens.shape != (reqs,):
        raise ValueError(
            f"q {list(q.shape)}, cache {list(kv_cache.shape)}, tables {list(tables.shape)} and "
            f"seq_lens {list(seq_lens.shape)} do not fit together"
        )
    q = q.contiguous()
    tables = tables.to(torch.int32).contiguous()
    seq_lens = seq_lens.to(torch.int64).contiguous()
    out = torch.empty_like(q)
    status = require(lib).paged_decode_f32(
        torch.get_num_threads(), q.data_ptr(), kv_cache.data_ptr(), num_blocks, block_size, kv_heads,
        dim, tables.data_ptr(), tables.shape[1], seq_lens.data_ptr(), reqs, heads, scale,
        sliding_window or 0, out.data_ptr(),
    )  # fmt: skip
    if status:
        raise RuntimeError(f"paged_decode_f32 failed ({status})")
    return out
