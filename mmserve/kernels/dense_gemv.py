"""Products of one row (or a few) with a dense weight, y = x W^T, by Triton kernels of our own
(issue 23, target 1): cuBLAS's one-row products leave bandwidth unread (session 38, an H100: o
4096 x 4096 at 1.7-2.2 TB/s, qkv 2.5, against gate_up's 3.0), and a step's small operations can
only be fused into a product whose kernel is ours.

Each program takes BLOCK_N output channels and one K slice (k_splits: about programs_per_sm
programs an SM); its loop reads tiles [BLOCK_N, BLOCK_K] of W (each channel's BLOCK_K weights
contiguous: 16-byte loads along K) and the matching BLOCK_K activations, multiplies them in
float32 into an accumulator of the tile's shape, and sums it along K once at the end. Split
products end as every split product here does (_common.store_tile: SERIAL_SPLITS's last
program, else sum_splits).
- dense_gemv: 16-bit (or float32) x and W, one row (_dense_gemv_kernel) or up to MAX_ROWS
  (_dense_rows_kernel: each weight tile read once for all the rows). Reference: x.float() @
  W.float().T.
- scaled_gemv: one row of FP8 / INT8 operands with their scales, fp8_gemm_rows's product.
  Reference: fp8_gemm.fp8_gemm_rows_ref."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from mmserve.kernels._common import (
    check_same_device,
    finish_splits,
    grid_sms,
    k_splits,
    pdl_launch,
    pdl_wait,
    split_target,
    store_args,
    store_tile,
)


@dataclass(frozen=True)
class GemvTiling:
    """A launch's tile and grid: BLOCK_N channels a program, BLOCK_K weights of each a step,
    warps a program, Triton's software-pipeline depth (None: its default) and programs an SM
    (the K split)."""

    block_n: int = 2
    block_k: int = 2048
    num_warps: int = 8
    num_stages: int | None = None
    programs_per_sm: int = 8


# On an H100 (session 40, scripts/sweep_dense_gemv.py, the product alone in CUDA graphs, 16 weight
# copies, us; cuBLAS's F.linear in brackets): qkv 6144 x 4096 17.5 (20.4), o 4096 x 4096 12.2
# (15.6), gate_up 28672 x 4096 74.8 (81.6: 3,138 against 2,880 GB/s), down 4096 x 14336 39.3
# (45.6), the LM head 128256 x 4096 327.7 (370.4): a layer's four 143.9 against 163.2. Two channels
# a program and 2,048 weights a step at 8 warps was the best of 56 tilings around the best of 148
# (8 channels, 512 weights, 4 warps: 147.0 a layer).
DEFAULT_TILING = GemvTiling()


@triton.jit
def _dense_gemv_kernel(
    out_ptr, x_ptr, w_ptr, bias_ptr, xs_ptr, ws_ptr, n, k, k_per_split, stride_w, final_ptr, counters_ptr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN: tl.constexpr, HAS_BIAS: tl.constexpr,
    SCALED: tl.constexpr, INT8: tl.constexpr, SPLIT: tl.constexpr, SERIAL: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """Program (tile, slice): out[tile's channels] (or the slice's partial) = sum over the slice's
    K of w[channel, k] x[k], in float32 (INT8: int32, exact), times x's scale and the channel's
    (SCALED), plus the bias (in the first slice's partial). EVEN: n a multiple of BLOCK_N and
    every slice whole steps of BLOCK_K inside K (no masks)."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < n
    k_lo = tl.program_id(1) * k_per_split
    k_hi = tl.minimum(k, k_lo + k_per_split)
    rows = w_ptr + offs_n[:, None].to(tl.int64) * stride_w
    pdl_wait(PDL)
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.int32 if INT8 else tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        if EVEN:
            w = tl.load(rows + offs_k[None, :], eviction_policy="evict_first")
            x = tl.load(x_ptr + offs_k)
        else:
            mask_k = offs_k < k_hi
            w = tl.load(rows + offs_k[None, :], mask=mask_n[:, None] & mask_k[None, :], other=0.0,
                        eviction_policy="evict_first")  # fmt: skip
            x = tl.load(x_ptr + offs_k, mask=mask_k, other=0.0)
        if INT8:
            acc += w.to(tl.int32) * x.to(tl.int32)[None, :]
        else:
            acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
    y = tl.sum(acc, axis=1).to(tl.float32)
    if SCALED:
        y *= tl.load(xs_ptr) * tl.load(ws_ptr + offs_n, mask=mask_n, other=0.0)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)
        y += tl.where(tl.program_id(1) == 0, bias, 0.0)
    store_tile(out_ptr, y, offs_n, mask_n, n, final_ptr, counters_ptr, SPLIT, SERIAL)


@triton.jit
def _dense_rows_kernel(
    out_ptr, x_ptr, w_ptr, bias_ptr, rows, n, k, k_per_split, stride_x, stride_w, final_ptr, counters_ptr,
    ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, HAS_BIAS: tl.constexpr,
    SPLIT: tl.constexpr, SERIAL: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """_dense_gemv_kernel for a few rows (ROWS: their count padded to a power of two): each weight
    tile read once for all of them, one float32 accumulator [ROWS, BLOCK_N, BLOCK_K]."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, ROWS)
    mask_n = offs_n < n
    mask_m = offs_m < rows
    k_lo = tl.program_id(1) * k_per_split
    k_hi = tl.minimum(k, k_lo + k_per_split)
    pdl_wait(PDL)
    acc = tl.zeros([ROWS, BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < k_hi
        w = tl.load(w_ptr + offs_n[:, None].to(tl.int64) * stride_w + offs_k[None, :],
                    mask=mask_n[:, None] & mask_k[None, :], other=0.0, eviction_policy="evict_first")  # fmt: skip
        x = tl.load(x_ptr + offs_m[:, None] * stride_x + offs_k[None, :], mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        acc += w.to(tl.float32)[None, :, :] * x.to(tl.float32)[:, None, :]
    y = tl.sum(acc, axis=2)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)
        y += tl.where(tl.program_id(1) == 0, bias, 0.0)[None, :]
    offs = offs_m[:, None] * n + offs_n[None, :]
    store_tile(out_ptr, y, offs, mask_m[:, None] & mask_n[None, :], rows * n, final_ptr, counters_ptr, SPLIT, SERIAL)


def dense_gemv(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, out: torch.Tensor | None = None,
    tiling: GemvTiling | None = None,
) -> torch.Tensor:  # fmt: skip
    """x [R, K] (R at most MAX_ROWS; or [K], one row) times weight [N, K] (rows contiguous)
    transposed, plus bias [N]: [R, N] in x's dtype (out, when given: [R, N] contiguous, x's
    dtype). A step is at most K's next power of two wide. tiling: DEFAULT_TILING for one row,
    rows_tiling(R) for more."""
    check_same_device(x=x, weight=weight)
    x = x.reshape(1, -1) if x.dim() == 1 else x
    if x.dim() != 2 or not 1 <= x.shape[0] <= MAX_ROWS:
        raise ValueError(f"x must be [rows, K] with 1-{MAX_ROWS} rows, got {list(x.shape)}")
    if x.dtype != weight.dtype:
        raise ValueError(f"x is {x.dtype}, weight {weight.dtype}: one dtype expected")
    default = DEFAULT_TILING if x.shape[0] == 1 else rows_tiling(x.shape[0])
    return _launch(x, weight, bias, None, out, x.dtype, tiling or default)


def scaled_gemv(
    xq: torch.Tensor, x_scale: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor,
    out_dtype: torch.dtype = torch.bfloat16, bias: torch.Tensor | None = None,
    tiling: GemvTiling | None = None,
) -> torch.Tensor:  # fmt: skip
    """fp8_gemm_rows's product for one row: xq [1, K] and wq [N, K] in float8_e4m3fn or int8 (one
    dtype), x_scale one float32 value ([1, 1]), w_scale [1, N] (or [N]) float32: (xq wq^T) x_scale
    w_scale (+ bias) as [1, N] in out_dtype. Products of float8 values are exact in float32 and
    summed in float32; int8's in int32. Where K is split (a product of few channels) each slice
    is scaled before the slices are added."""
    check_same_device(xq=xq, wq=wq, x_scale=x_scale, w_scale=w_scale)
    if xq.dtype != wq.dtype or wq.dtype not in (torch.float8_e4m3fn, torch.int8):
        raise ValueError(f"xq and wq must both be float8_e4m3fn or int8, got {xq.dtype} and {wq.dtype}")
    n = wq.shape[0]
    if x_scale.numel() != 1 or w_scale.numel() != n:
        raise ValueError(f"x_scale must hold 1 value and w_scale {n}, got {x_scale.numel()} and {w_scale.numel()}")
    scales = (x_scale.float().reshape(1), w_scale.float().reshape(n).contiguous())
    return _launch(xq.reshape(1, -1), wq, bias, scales, None, out_dtype, tiling or SCALED_TILING)


def _launch(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
    scales: tuple[torch.Tensor, torch.Tensor] | None, out: torch.Tensor | None, out_dtype: torch.dtype,
    t: GemvTiling,
) -> torch.Tensor:  # fmt: skip
    (rows, k_x), (n, k) = x.shape, weight.shape
    if k_x != k:
        raise ValueError(f"x has {k_x} columns, weight {k}")
    if weight.stride(1) != 1 or x.stride(1) != 1 or (rows == 1 and not x.is_contiguous()):
        raise ValueError("weight's rows and x's must be contiguous")
    if bias is not None and (bias.shape != (n,) or bias.device != x.device):
        raise ValueError(f"bias must be [{n}] on {x.device}, got {list(bias.shape)} on {bias.device}")
    if out is None:
        out = torch.empty(rows, n, dtype=out_dtype, device=x.device)
    elif out.shape != (rows, n) or out.dtype != out_dtype or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous [{rows}, {n}] {out_dtype} tensor")
    block_k = min(t.block_k, triton.next_power_of_2(k))
    tiles, steps = triton.cdiv(n, t.block_n), triton.cdiv(k, block_k)
    splits, per_split = k_splits(tiles, steps, grid_sms(x.device), t.programs_per_sm)
    target, counters = split_target(out, splits, tiles)
    meta: dict[str, object] = {"num_warps": t.num_warps, **store_args(out, counters), **pdl_launch(x.device)}
    if t.num_stages is not None:
        meta["num_stages"] = t.num_stages
    bias_arg = weight if bias is None else bias
    if rows > 1:
        _dense_rows_kernel[(tiles, splits)](
            target, x, weight, bias_arg, rows, n, k, per_split * block_k, x.stride(0), weight.stride(0),
            ROWS=triton.next_power_of_2(rows), BLOCK_N=t.block_n, BLOCK_K=block_k, HAS_BIAS=bias is not None,
            SPLIT=splits > 1, **meta,
        )  # fmt: skip
        return finish_splits(out, target, counters)
    xs, ws = scales if scales is not None else (weight, weight)
    _dense_gemv_kernel[(tiles, splits)](
        target, x, weight, bias_arg, xs, ws, n, k, per_split * block_k, weight.stride(0),
        BLOCK_N=t.block_n, BLOCK_K=block_k, EVEN=n % t.block_n == 0 and k % block_k == 0,
        HAS_BIAS=bias is not None, SCALED=scales is not None, INT8=weight.dtype == torch.int8,
        SPLIT=splits > 1, **meta,
    )  # fmt: skip
    return finish_splits(out, target, counters)


MAX_ROWS = 8  # dense_gemv's rows at most (its accumulator holds a tile for each)


def rows_tiling(rows: int) -> GemvTiling:
    """A few rows' tiling: DEFAULT_TILING's, its step narrowed so the accumulators' registers stay
    those of one row (not swept yet)."""
    padded = triton.next_power_of_2(rows)
    return GemvTiling(DEFAULT_TILING.block_n, max(256, DEFAULT_TILING.block_k // padded), DEFAULT_TILING.num_warps,
                      DEFAULT_TILING.num_stages, DEFAULT_TILING.programs_per_sm)  # fmt: skip


# one-byte weights (scaled_gemv). On the H200 (session 42, `scripts/sweep_dense_gemv.py --fp8`, the
# product alone, us, qkv / o / gate_up / down at the 8B shape): 2 channels, 2,048 a step, 4 warps
# 9.44 / 7.05 / 34.33 / 16.63, a layer's four 67.45 against the FP8 rows kernel's 71.92 (13.02 /
# 8.69 / 31.72 / 18.49); the tiling before (4,096 a step, 8 warps) was not among the best
SCALED_TILING = GemvTiling(block_n=2, block_k=2048, num_warps=4)


# Whether a loaded model's plain 16-bit nn.Linear projections on CUDA take their products of up
# to ENGINE_ROWS rows from dense_gemv (models/layers.FewRowsLinear; more rows stay F.linear's).
# Batch-1 decode (session 40, `scripts/ab_switch.py mmserve.kernels.dense_gemv.ENGINE=True|False
# -- latency --model shape:llama3-8b --load-format dummy --input-len 128 --output-len 128
# --max-num-seqs 1`, two pairs each): on the H200 4.05 against 4.69 ms/token with cuBLAS; on an
# H100, the tiling then 8 x 512 at 4 warps, 5.65 against 6.13
ENGINE = True
# the most rows a swapped projection sends here. 2-8 rows on the rows kernel lose to cuBLAS: on the
# H200 (session 42) a decode step at 512 context took 6.62 / 10.67 / 18.84 ms at 2 / 4 / 8 rows
# with ENGINE_ROWS=8 against 4.78 / 4.83 / 4.91 with 1
ENGINE_ROWS = 1
