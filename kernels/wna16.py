"""Weight-only int4 / int8 products (w4a16, w8a16): out = x @ W^T with W dequantised inside the
product, W[n, k] = (q[k, n] - z[g, n]) * s[g, n] for k's group g = k // group_size.

One layout serves every weight-only format after repacking at load (models/weight_only.py:
compressed-tensors pack-quantized, GPTQ, AWQ): qweight int32 [K / per, N] with per = 32 / bits
values of consecutive input channels in each word, value j of a word at bits j * bits (GPTQ's
own order); scales and zeros [groups, N] in the compute dtype (zeros as unsigned values, so a
symmetric format has zeros of 2^(bits - 1)). An act-order checkpoint's input channels are
permuted at load so that groups are contiguous; the caller permutes x the same way.

A program owns BLOCK_M rows by BLOCK_N output channels and walks K in steps of up to 128: it
loads each packed word once, unpacks it to its per values in registers, dequantises with one row
of scales and zeros where the step lies inside one group, and multiplies on the tensor cores
with fp32 accumulation. For a decode step (a few rows) the weights stream from memory once,
with K split into slices when the output tiles alone are too few for the SMs; a large batch
re-reads them once per row tile.
(The first version, one word load per value and 32-channel steps, took 18 ms per 8B decode
step on the H200, 15x its bandwidth floor: latency-bound on its serial K loop.)"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from mmserve.kernels._common import (
    check_float,
    check_last_dim_contiguous,
    check_same_device,
    num_sms,
)

MAX_BLOCK_K = 128  # K per step when the group size allows (a multiple of 8: whole words)
PROGRAMS_PER_SM = 4  # a grid smaller than this many programs per SM splits K
MAX_SPLITS = 16


@triton.jit
def _wna16_kernel(
    out_ptr, x_ptr, qweight_ptr, scales_ptr, zeros_ptr,
    rows, n, k, group_size, k_per_split, stride_x, stride_q, stride_s, stride_out,
    BITS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ONE_GROUP: tl.constexpr, SPLIT: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_s = tl.program_id(2)  # this program's slice of K: [k_lo, k_hi), whole steps
    k_lo = pid_s * k_per_split
    k_hi = tl.minimum(k, k_lo + k_per_split)
    PER: tl.constexpr = 32 // BITS
    WORDS: tl.constexpr = BLOCK_K // PER
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    offs_w = tl.arange(0, WORDS)
    shifts = tl.arange(0, PER) * BITS
    mask_m = offs_m < rows
    mask_n = offs_n < n
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for start in range(k_lo, k_hi, BLOCK_K):
        ks = start + offs_k
        mask_k = ks < k_hi
        x = tl.load(
            x_ptr + offs_m[:, None].to(tl.int64) * stride_x + ks[None, :],
            mask=mask_m[:, None] & mask_k[None, :], other=0.0,
        )  # fmt: skip
        word_rows = start // PER + offs_w
        words = tl.load(  # each word once: [WORDS, BLOCK_N], unpacked to [BLOCK_K, BLOCK_N]
            qweight_ptr + word_rows[:, None].to(tl.int64) * stride_q + offs_n[None, :],
            mask=(word_rows < k_hi // PER)[:, None] & mask_n[None, :], other=0,
        )  # fmt: skip
        q = (words[:, None, :] >> shifts[None, :, None]) & ((1 << BITS) - 1)
        q = tl.reshape(q, [BLOCK_K, BLOCK_N]).to(tl.float32)
        if ONE_GROUP:  # the step lies in one group: a row of scales and zeros
            group = (start // group_size).to(tl.int64) * stride_s + offs_n
            s = tl.load(scales_ptr + group, mask=mask_n, other=0.0).to(tl.float32)
            z = tl.load(zeros_ptr + group, mask=mask_n, other=0.0).to(tl.float32)
            w = ((q - z[None, :]) * s[None, :]).to(x.dtype)
        else:
            wk_mask = mask_k[:, None] & mask_n[None, :]
            group = (ks // group_size)[:, None].to(tl.int64) * stride_s + offs_n[None, :]
            s = tl.load(scales_ptr + group, mask=wk_mask, other=0.0).to(tl.float32)
            z = tl.load(zeros_ptr + group, mask=wk_mask, other=0.0).to(tl.float32)
            w = ((q - z) * s).to(x.dtype)  # [BLOCK_K, BLOCK_N]
        acc = tl.dot(x, w, acc, input_precision=DOT_PRECISION)
    out_offs = offs_m[:, None].to(tl.int64) * stride_out + offs_n[None, :]
    if SPLIT:  # float32 partials [splits, rows, n], summed in order by _sum_splits_kernel
        out_offs += pid_s.to(tl.int64) * rows * n
    tl.store(out_ptr + out_offs, acc.to(out_ptr.dtype.element_ty),
             mask=mask_m[:, None] & mask_n[None, :])  # fmt: skip


@triton.jit
def _sum_splits_kernel(out_ptr, part_ptr, size, splits, BLOCK: tl.constexpr):
    """out[i] = sum over s of part[s, i], s in order (the same result every run)."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < size
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for s in range(splits):
        acc += tl.load(part_ptr + s * size + offs, mask=mask, other=0.0)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


@dataclass(frozen=True)
class Wna16Tiling:
    block_m: int
    block_n: int
    block_k: int
    one_group: bool  # block_k divides the group size: one row of scales per step
    num_warps: int
    num_stages: int
    splits: int  # slices of K, each its own program (then summed)
    k_per_split: int  # channels of K per slice, whole steps


def choose_tiling(rows: int, n: int, k: int, group_size: int, num_sms: int) -> Wna16Tiling:
    """Output tiles of 16 x 64 for a decode step (<= 16 rows: its weights are all the work,
    streamed once), wider for more rows; K steps of up to 128 that stay inside one group where
    the size allows. A grid of too few output tiles to keep about PROGRAMS_PER_SM programs on
    every SM splits K (each slice of whole steps, partial sums added in order), since one
    program's serial K steps are latency-bound: at one row, 4096 x 4096 took 35-63 us on the
    H200 for every tiling without a split (BENCHMARKS.md, session 11), about 10x its floor."""
    block_m = 16 if rows <= 16 else 32 if rows <= 32 else 64
    block_n = 64 if block_m < 64 else 128
    block_k = next((b for b in (MAX_BLOCK_K, 64, 32, 16, 8) if group_size % b == 0), 0)
    one_group = block_k >= 32
    if not one_group:
        block_k = 32
    tiles = triton.cdiv(rows, block_m) * triton.cdiv(n, block_n)
    steps = triton.cdiv(k, block_k)
    wanted = min(MAX_SPLITS, steps, triton.cdiv(PROGRAMS_PER_SM * num_sms, tiles))
    per_split = triton.cdiv(steps, max(1, wanted))
    splits = triton.cdiv(steps, per_split)
    stages = 3 if block_m <= 32 else 2
    return Wna16Tiling(block_m, block_n, block_k, one_group, 4, stages, splits, per_split * block_k)


def _check(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
           bits: int, group_size: int) -> None:  # fmt: skip
    if bits not in (4, 8):
        raise ValueError(f"bits must be 4 or 8, got {bits}")
    if x.dim() != 2:
        raise ValueError(f"x must be [rows, K], got {list(x.shape)}")
    if qweight.dim() != 2 or qweight.dtype != torch.int32:
        raise ValueError(f"qweight must be int32 [K / {32 // bits}, N], got {qweight.dtype} {list(qweight.shape)}")
    k, n = x.shape[1], qweight.shape[1]
    if qweight.shape[0] * (32 // bits) != k:
        raise ValueError(f"qweight has {qweight.shape[0]} rows of words for K = {k} at {bits} bits")
    groups = -(-k // group_size) if group_size > 0 else 0
    if group_size < 1 or tuple(scales.shape) != (groups, n) or scales.shape != zeros.shape:
        raise ValueError(
            f"scales and zeros must be [{groups}, {n}] (group_size {group_size}), got "
            f"{list(scales.shape)} and {list(zeros.shape)}"
        )
    check_float("x", x)
    for name, t in (("x", x), ("qweight", qweight), ("scales", scales), ("zeros", zeros)):
        check_last_dim_contiguous(name, t)
    check_same_device(x=x, qweight=qweight, scales=scales, zeros=zeros)


def wna16_gemm(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    bits: int,
    group_size: int,
) -> torch.Tensor:
    """x [M, K] (float32/float16/bfloat16) times the packed weight: [M, N] in x's dtype."""
    _check(x, qweight, scales, zeros, bits, group_size)
    rows, k = x.shape
    n = qweight.shape[1]
    out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    if rows == 0 or n == 0:
        return out
    t = choose_tiling(rows, n, k, group_size, num_sms(x.device) if x.is_cuda else 132)
    split = t.splits > 1
    target = torch.empty(t.splits, rows, n, dtype=torch.float32, device=x.device) if split else out
    grid = (triton.cdiv(rows, t.block_m), triton.cdiv(n, t.block_n), t.splits)
    _wna16_kernel[grid](
        target, x, qweight, scales, zeros,
        rows, n, k, group_size, t.k_per_split,
        x.stride(0), qweight.stride(0), scales.stride(0), n if split else out.stride(0),
        BITS=bits, BLOCK_M=t.block_m, BLOCK_N=t.block_n, BLOCK_K=t.block_k, ONE_GROUP=t.one_group,
        SPLIT=split, DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=t.num_warps, num_stages=t.num_stages,
    )  # fmt: skip
    if split:
        block = 1024
        _sum_splits_kernel[(triton.cdiv(rows * n, block),)](out, target, rows * n, t.splits, BLOCK=block)
    return out


def dequantize_packed(
    qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, bits: int, group_size: int
) -> torch.Tensor:
    """The torch reference of the layout: W [N, K] float32."""
    per = 32 // bits
    shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=qweight.device)
    q = (qweight.unsqueeze(1) >> shifts.view(1, per, 1)) & ((1 << bits) - 1)  # [K/per, per, N]
    q = q.reshape(-1, qweight.shape[1]).float()  # [K, N]
    groups = torch.arange(q.shape[0], device=q.device) // group_size
    return ((q - zeros.float()[groups]) * scales.float()[groups]).t()


def wna16_gemm_ref(
    x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
    bits: int, group_size: int,
) -> torch.Tensor:  # fmt: skip
    """float32 [M, N]: x times the dequantised weight."""
    return x.float() @ dequantize_packed(qweight, scales, zeros, bits, group_size).t()


def pack_columns(q: torch.Tensor, bits: int) -> torch.Tensor:
    """Unsigned values [K, N] (K a multiple of 32 / bits) -> the layout's int32 [K / per, N]."""
    per = 32 // bits
    k, n = q.shape
    if k % per:
        raise ValueError(f"K = {k} is not a multiple of {per} (values per int32 at {bits} bits)")
    shifts = torch.arange(0, 32, bits, dtype=torch.int64, device=q.device).view(1, per, 1)
    words = (q.to(torch.int64).view(k // per, per, n) << shifts).sum(1)  # (disjoint bits)
    return (words - ((words >> 31) << 32)).to(torch.int32)
