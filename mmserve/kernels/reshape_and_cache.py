"""KV-cache write: copies each new token's K and V into its slot of the paged cache.

kv_cache: [2, num_blocks, block_size, num_kv_heads, head_dim] (K then V); slot s lives at
block s // block_size, row s % block_size. A slot of -1 (a padding token) is skipped.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from mmserve.kernels._common import (
    check_cache_dtype,
    check_float,
    check_index_dtype,
    check_last_dim_contiguous,
    check_ndim,
    check_same_device,
    check_shape,
    to_cache,
)
from mmserve.kernels.paged_ref import NO_SCALES, write_kv_cache


@triton.jit
def _reshape_and_cache_kernel(
    k_ptr, v_ptr, key_cache_ptr, value_cache_ptr, slot_mapping_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_cb, stride_cs, stride_ch,  # shared: key and value caches are halves of one tensor
    num_kv_heads, head_dim, k_inv_scale, v_inv_scale,
    BLOCK_SIZE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, FP8: tl.constexpr,
):  # fmt: skip
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    heads = tl.arange(0, BLOCK_H)[:, None]
    dims = tl.arange(0, BLOCK_D)[None, :]
    mask = (heads < num_kv_heads) & (dims < head_dim)
    cache_offs = (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_cs
    cache_offs += heads * stride_ch + dims
    k = tl.load(k_ptr + token * stride_kt + heads * stride_kh + dims, mask=mask)
    v = tl.load(v_ptr + token * stride_vt + heads * stride_vh + dims, mask=mask)
    dtype = key_cache_ptr.dtype.element_ty
    tl.store(key_cache_ptr + cache_offs, to_cache(k, k_inv_scale, dtype, FP8), mask=mask)
    tl.store(value_cache_ptr + cache_offs, to_cache(v, v_inv_scale, dtype, FP8), mask=mask)


def check_cache_write(
    k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """The shape, dtype and device checks of writing k, v into kv_cache at slot_mapping."""
    check_ndim("k", k, 3, "[num_tokens, num_kv_heads, head_dim]")
    check_shape("v", v, tuple(k.shape))
    num_tokens, num_kv_heads, head_dim = k.shape
    check_ndim("kv_cache", kv_cache, 5, "[2, num_blocks, block_size, num_kv_heads, head_dim]")
    check_shape("kv_cache", kv_cache, (2, *kv_cache.shape[1:3], num_kv_heads, head_dim))
    check_shape("slot_mapping", slot_mapping, (num_tokens,))
    check_index_dtype("slot_mapping", slot_mapping, torch.int32, torch.int64)
    for name, t in (("k", k), ("v", v)):
        check_float(name, t)
        check_last_dim_contiguous(name, t)
    check_cache_dtype("kv_cache", kv_cache)
    check_last_dim_contiguous("kv_cache", kv_cache)
    check_same_device(k=k, v=v, kv_cache=kv_cache, slot_mapping=slot_mapping)


def cache_write_args(kv_cache: torch.Tensor, scales: tuple[float, float]) -> dict[str, object]:
    """The kernels' FP8 arguments for writing into kv_cache with (K's, V's) scales."""
    check_scales(scales)
    return {"k_inv_scale": 1.0 / scales[0], "v_inv_scale": 1.0 / scales[1],
            "FP8": kv_cache.dtype == torch.float8_e4m3fn}  # fmt: skip


def check_scales(scales: tuple[float, float]) -> None:
    if not all(math.isfinite(s) and s > 0 for s in scales):
        raise ValueError(f"kv_scales must be finite and positive, got {scales}")


def reshape_and_cache(
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_scales: tuple[float, float] = NO_SCALES,
) -> None:
    """Writes k, v [T, Hkv, D] into kv_cache [2, num_blocks, block_size, Hkv, D] at slot_mapping
    [T] (int32/int64, -1 = skip). Slots must lie in [-1, num_blocks * block_size); they are not
    range-checked (that would cost a device sync). An FP8 cache stores x / scale, saturated
    (kv_scales: K's and V's)."""
    check_cache_write(k, v, kv_cache, slot_mapping)
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    key_cache, value_cache = kv_cache[0], kv_cache[1]
    block_d = triton.next_power_of_2(head_dim)
    _reshape_and_cache_kernel[(num_tokens,)](
        k, v, key_cache, value_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        num_kv_heads, head_dim, **cache_write_args(kv_cache, kv_scales),
        BLOCK_SIZE=kv_cache.shape[2],
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=block_d,
        num_warps=4 if num_kv_heads * block_d >= 1024 else 1,
    )  # fmt: skip


def reshape_and_cache_ref(
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_scales: tuple[float, float] = NO_SCALES,
) -> None:
    """The torch reference: the CPU backend's own cache write."""
    write_kv_cache(k, v, kv_cache, slot_mapping, kv_scales)
