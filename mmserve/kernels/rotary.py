"""Rotary position embedding, neox style (rotate_half, as in HF Llama), on q and k together
(one launch for both).

For head_dim D and half = D/2: out[:half] = x1*cos1 - x2*sin1 and out[half:] = x2*cos2 + x1*sin2,
where x1, x2 are the halves of x. cos/sin tables are [max_pos, D/2] (cos1 = cos2) or HF's
[max_pos, D] (cos1, cos2 are its two halves). Arithmetic is fp32, rounded once to x's dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from mmserve.kernels._common import (
    check_float,
    check_index_dtype,
    check_last_dim_contiguous,
    check_ndim,
    check_same_device,
    check_shape,
    pdl_launch,
    pdl_wait,
    to_cache,
)
from mmserve.kernels.reshape_and_cache import cache_write_args, check_cache_write


@triton.jit
def _cos_sin(positions_ptr, cos_ptr, sin_ptr, token, stride_table, second_half_col, cols, col_mask):
    """The token's cos and sin for the first and the second half of a head, in fp32."""
    row = tl.load(positions_ptr + token).to(tl.int64) * stride_table
    cos1 = tl.load(cos_ptr + row + cols, mask=col_mask, other=0.0).to(tl.float32)
    sin1 = tl.load(sin_ptr + row + cols, mask=col_mask, other=0.0).to(tl.float32)
    cos2 = tl.load(cos_ptr + row + second_half_col + cols, mask=col_mask, other=0.0).to(tl.float32)
    sin2 = tl.load(sin_ptr + row + second_half_col + cols, mask=col_mask, other=0.0).to(tl.float32)
    return cos1, sin1, cos2, sin2


@triton.jit
def _rotate_heads(
    out_ptr, x_ptr, token, first_head, num_heads, stride_xt, stride_xh, stride_ot, stride_oh,
    cos1, sin1, cos2, sin2, cols, col_mask, inv_scale,
    HALF: tl.constexpr, BLOCK_H: tl.constexpr, FP8: tl.constexpr,
):  # fmt: skip
    """FP8 (a cache's heads): stored as x / scale, saturated (inv_scale = 1 / scale)."""
    heads = first_head + tl.arange(0, BLOCK_H)[:, None]
    mask = (heads < num_heads) & col_mask
    x_offs = token * stride_xt + heads * stride_xh + cols
    x1 = tl.load(x_ptr + x_offs, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptr + x_offs + HALF, mask=mask, other=0.0).to(tl.float32)
    out_offs = token * stride_ot + heads * stride_oh + cols
    dtype = out_ptr.dtype.element_ty
    tl.store(out_ptr + out_offs, to_cache(x1 * cos1 - x2 * sin1, inv_scale, dtype, FP8), mask=mask)
    tl.store(
        out_ptr + out_offs + HALF, to_cache(x2 * cos2 + x1 * sin2, inv_scale, dtype, FP8), mask=mask
    )


@triton.jit
def _rotary_kernel(
    q_out_ptr, q_ptr, k_out_ptr, k_ptr, positions_ptr, cos_ptr, sin_ptr,
    stride_qt, stride_qh, stride_qot, stride_qoh, stride_kt, stride_kh, stride_kot, stride_koh,
    stride_table, second_half_col, num_q_heads, num_k_heads, q_blocks,
    HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
):  # fmt: skip
    """One launch for q and k: programs [0, q_blocks) rotate q's heads, the rest k's."""
    token = tl.program_id(0).to(tl.int64)
    block = tl.program_id(1)
    cols = tl.arange(0, BLOCK_HALF)[None, :]
    col_mask = cols < HALF
    cos1, sin1, cos2, sin2 = _cos_sin(
        positions_ptr, cos_ptr, sin_ptr, token, stride_table, second_half_col, cols, col_mask
    )
    if block < q_blocks:
        _rotate_heads(
            q_out_ptr, q_ptr, token, block * BLOCK_H, num_q_heads,
            stride_qt, stride_qh, stride_qot, stride_qoh, cos1, sin1, cos2, sin2, cols, col_mask,
            1.0, HALF, BLOCK_H, False,
        )  # fmt: skip
    else:
        _rotate_heads(
            k_out_ptr, k_ptr, token, (block - q_blocks) * BLOCK_H, num_k_heads,
            stride_kt, stride_kh, stride_kot, stride_koh, cos1, sin1, cos2, sin2, cols, col_mask,
            1.0, HALF, BLOCK_H, False,
        )  # fmt: skip


def _apply(
    q_out: torch.Tensor,
    q: torch.Tensor,
    k_out: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
) -> None:
    t = _tiling(q, k, cos)
    _rotary_kernel[t.grid](
        q_out, q, k_out, k, positions, cos, sin,
        q.stride(0), q.stride(1), q_out.stride(0), q_out.stride(1),
        k.stride(0), k.stride(1), k_out.stride(0), k_out.stride(1),
        cos.stride(0), t.second_half_col, q.shape[1], k.shape[1], t.q_blocks,
        HALF=t.half, BLOCK_H=t.block_h, BLOCK_HALF=t.block_half, num_warps=t.num_warps,
    )  # fmt: skip


@dataclass(frozen=True)
class _Tiling:
    """Launch shape: one program per (token, block of BLOCK_H heads), q's blocks first."""

    half: int
    block_half: int
    block_h: int
    q_blocks: int
    grid: tuple[int, int]
    second_half_col: int  # where cos/sin's second half starts in a row (0: half tables)
    num_warps: int


def _tiling(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor) -> _Tiling:
    num_tokens, num_q_heads, head_dim = q.shape
    num_k_heads = k.shape[1]
    half = head_dim // 2
    block_half = triton.next_power_of_2(half)
    block_h = min(triton.next_power_of_2(max(num_q_heads, num_k_heads)), max(1, 2048 // block_half))
    q_blocks = triton.cdiv(num_q_heads, block_h)
    return _Tiling(
        half,
        block_half,
        block_h,
        q_blocks,
        (num_tokens, q_blocks + triton.cdiv(num_k_heads, block_h)),
        half if cos.shape[1] == head_dim else 0,
        4 if block_h * block_half >= 1024 else 1,
    )


def _check_inputs(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> None:
    check_ndim("q", q, 3, "[num_tokens, num_heads, head_dim]")
    check_ndim("k", k, 3, "[num_tokens, num_kv_heads, head_dim]")
    num_tokens, _, head_dim = q.shape
    if head_dim % 2:
        raise ValueError(f"head_dim must be even, got {head_dim}")
    check_shape("k", k, (num_tokens, k.shape[1], head_dim))
    check_shape("positions", positions, (num_tokens,))
    check_index_dtype("positions", positions, torch.int32, torch.int64)
    check_ndim("cos", cos, 2, "[max_pos, head_dim / 2] or [max_pos, head_dim]")
    if cos.shape[1] not in (head_dim // 2, head_dim):
        raise ValueError(
            f"cos must be [max_pos, {head_dim // 2}] or [max_pos, {head_dim}], "
            f"got {list(cos.shape)}"
        )
    check_shape("sin", sin, tuple(cos.shape))
    for name, t in (("q", q), ("k", k), ("cos", cos), ("sin", sin)):
        check_float(name, t)
        check_last_dim_contiguous(name, t)
    if sin.stride(0) != cos.stride(0):
        raise ValueError("cos and sin must have the same row stride")
    check_same_device(positions=positions, q=q, k=k, cos=cos, sin=sin)


def rotary_embedding(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    inplace: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotates q [T, H, D] and k [T, Hkv, D] at positions [T] (int32/int64, each below
    max_pos; not range-checked, that would cost a device sync). cos, sin: [max_pos, D/2] or
    [max_pos, D]. Returns (q, k) rotated: the inputs themselves when inplace, else new tensors."""
    _check_inputs(positions, q, k, cos, sin)
    q_out = q if inplace else torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = k if inplace else torch.empty(k.shape, dtype=k.dtype, device=k.device)
    if q.shape[0] > 0:
        _apply(q_out, q, k_out, k, positions, cos, sin)
    return q_out, k_out


@triton.jit
def _rotary_cache_kernel(
    q_out_ptr, q_ptr, k_ptr, v_ptr, key_cache_ptr, value_cache_ptr, slot_mapping_ptr,
    positions_ptr, cos_ptr, sin_ptr,
    stride_qt, stride_qh, stride_qot, stride_qoh, stride_kt, stride_kh, stride_vt, stride_vh,
    stride_cb, stride_cs, stride_ch,  # shared: key and value caches are halves of one tensor
    stride_table, second_half_col, num_q_heads, num_k_heads, q_blocks, k_inv_scale, v_inv_scale,
    HALF: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
    FP8: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """Programs [0, q_blocks) rotate q's heads into q_out; the rest rotate k's heads into the
    key cache at the token's slot and copy v's into the value cache (slot -1: skipped)."""
    token = tl.program_id(0).to(tl.int64)
    block = tl.program_id(1)
    cols = tl.arange(0, BLOCK_HALF)[None, :]
    pdl_wait(PDL)
    col_mask = cols < HALF
    cos1, sin1, cos2, sin2 = _cos_sin(
        positions_ptr, cos_ptr, sin_ptr, token, stride_table, second_half_col, cols, col_mask
    )
    if block < q_blocks:
        _rotate_heads(
            q_out_ptr, q_ptr, token, block * BLOCK_H, num_q_heads,
            stride_qt, stride_qh, stride_qot, stride_qoh, cos1, sin1, cos2, sin2, cols, col_mask,
            1.0, HALF, BLOCK_H, False,
        )  # fmt: skip
    else:
        slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
        if slot >= 0:
            first = (block - q_blocks) * BLOCK_H
            base = (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_cs
            _rotate_heads(
                key_cache_ptr + base, k_ptr, token, first, num_k_heads,
                stride_kt, stride_kh, 0, stride_ch, cos1, sin1, cos2, sin2, cols, col_mask,
                k_inv_scale, HALF, BLOCK_H, FP8,
            )  # fmt: skip
            heads = first + tl.arange(0, BLOCK_H)[:, None]
            mask = (heads < num_k_heads) & col_mask
            v_offs = token * stride_vt + heads * stride_vh + cols
            cache_offs = base + heads * stride_ch + cols
            dtype = value_cache_ptr.dtype.element_ty
            v1 = tl.load(v_ptr + v_offs, mask=mask)
            v2 = tl.load(v_ptr + v_offs + HALF, mask=mask)
            tl.store(value_cache_ptr + cache_offs, to_cache(v1, v_inv_scale, dtype, FP8), mask=mask)
            tl.store(
                value_cache_ptr + cache_offs + HALF, to_cache(v2, v_inv_scale, dtype, FP8), mask=mask
            )


def rotary_embedding_and_cache(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_scales: tuple[float, float] = (1.0, 1.0),
) -> torch.Tensor:
    """rotary_embedding, then reshape_and_cache of the rotated k and of v, in one launch:
    returns q rotated (a new tensor); k rotated and v go only into kv_cache [2, num_blocks,
    block_size, Hkv, D] at slot_mapping [T] (-1 = skip; an FP8 cache with kv_scales). The
    checks of both."""
    _check_inputs(positions, q, k, cos, sin)
    check_cache_write(k, v, kv_cache, slot_mapping)
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if q.shape[0] == 0:
        return q_out
    t = _tiling(q, k, cos)
    key_cache, value_cache = kv_cache[0], kv_cache[1]
    _rotary_cache_kernel[t.grid](
        q_out, q, k, v, key_cache, value_cache, slot_mapping, positions, cos, sin,
        q.stride(0), q.stride(1), q_out.stride(0), q_out.stride(1),
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        cos.stride(0), t.second_half_col, q.shape[1], k.shape[1], t.q_blocks,
        **cache_write_args(kv_cache, kv_scales),
        HALF=t.half, BLOCK_SIZE=kv_cache.shape[2], BLOCK_H=t.block_h, BLOCK_HALF=t.block_half,
        num_warps=t.num_warps, **pdl_launch(q.device),
    )  # fmt: skip
    return q_out


def rotary_embedding_ref(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch reference: HF's q * cos + rotate_half(q) * sin, in fp32."""
    head_dim = q.shape[-1]
    if cos.shape[1] != head_dim:
        cos, sin = torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)
    cos_t = cos[positions.long()].float().unsqueeze(1)  # [T, 1, D]
    sin_t = sin[positions.long()].float().unsqueeze(1)

    def rotate(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.float().chunk(2, dim=-1)
        rotated = torch.cat((-x2, x1), dim=-1)
        return (x.float() * cos_t + rotated * sin_t).to(x.dtype)

    return rotate(q), rotate(k)
