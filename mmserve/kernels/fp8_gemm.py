"""FP8 x FP8 (and INT8 x INT8) products of a few rows (decode steps): out = (xq @ wq^T) *
x_scale * w_scale.

torch._scaled_mm's kernels are built for large products: at 1-32 rows they read an 8B model's
FP8 weights no faster than cuBLAS reads bf16 ones (measured on the H200), which throws away
FP8's halved bytes. Here each program owns BLOCK_N output channels, streams their weights once
over K, and multiplies on the tensor cores with the rows padded to 16 or 32. Same operands
and fp32 accumulation as _scaled_mm with row-wise scales, so a request's results change with
its batch's size only by the order of fp32 sums. Measured at one row: 89% of the copy
bandwidth on Llama-3-8B's gate_up projection, 70% on q/k/v, 60% on down (K = 14,336 over only
64 programs: K is not split).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mmserve.kernels._common import (
    check_at_least,
    check_last_dim_contiguous,
    check_same_device,
    check_scales,
    check_shape,
    last_of_splits,
    pdl_launch,
    pdl_wait,
    prefetch_count,
    prefetch_l2,
    scaled_operand_sizes,
    serial_counters,
    split_steps,
    sum_partials,
)

# rows are padded to a tile of 16, 32 or 64. A 64-row tile compiles to Hopper's wgmma, whose
# FP8 partial sums are narrower than float32: unpromoted, it missed the float32 reference by
# more than rounding (H200, session 6). Its sums are now promoted to float32 every
# PROMOTE_EVERY products, as torch._scaled_mm's own accumulation does, which brings it within
# that path's accuracy (tests/kernels/test_fp8_gemm.py at 48 and 64 rows, bf16 on the H200,
# session 31). models/fp8.py FEW_ROWS decides the rows that come here, FP8's and INT8's (64
# since sessions 31 and 32); up to 32 rows (mma) it is float32-exact.
MAX_ROWS = 64
PROMOTE_EVERY = 128
# a product of at most this many output tiles (0: none) splits K in SPLITS slices. Measured on
# the H200 (scripts/fp8_kernels.py, session 14): Llama-3-8B's o and down projections (64 tiles)
# at 1, 16 and 32 rows took 10.4/32.0, 10.1/31.0 and 13.2/41.0 us unsplit, 7.7/20.4, 7.9/20.2
# and 9.4/23.6 us in 2 slices (4 and 8 slices were slower at 1-16 rows); qkv (96 tiles) and
# gate_up (448) were fastest unsplit at 1-16 rows. A split by occupancy in its place (about 2, 4 or
# 8 programs an SM, _common.k_splits, as w4a16 splits) was slower at batch 1 on the H200 (session
# 42, 8B shape, ms/token): FP8 3.15 with this rule against 3.64 / 3.83 / 4.24; INT8 2.96 against
# 3.59 at 4
SPLIT_BELOW = 64
SPLITS = 2
# each program's first steps of weights (BLOCK_K of K for each of its channels a step) asked of
# L2 before pdl_wait (_common.prefetch_l2): under PDL their reads overlap the kernel before.
# 0: none. On an H100 (session 29, 8B shape, PDL on) FP8's batch-1 latency took 3.90 ms/token
# with 2 steps against 4.01 without (decode step 3.97 against 4.07)
PREFETCH_STEPS = 2


@triton.jit
def _fp8_gemm_rows_kernel(
    out_ptr, part_ptr, xq_ptr, xs_ptr, wq_ptr, ws_ptr, counters_ptr,
    rows, n, k, k_per_split, stride_x, stride_w, stride_out,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, INT8: tl.constexpr,
    SPLIT: tl.constexpr, PROMOTE: tl.constexpr, SERIAL: tl.constexpr, PDL: tl.constexpr,
    PREFETCH_LINES: tl.constexpr, ASM: tl.constexpr,
):  # fmt: skip
    """PREFETCH_LINES (a power of two, or 0): lines of 128 values of K, from the slice's start,
    of each of the program's channels asked of L2 before the wait."""
    pid = tl.program_id(0)
    pid_s = tl.program_id(1)  # this program's slice of K, whole tiles: [k_lo, k_hi)
    k_lo = pid_s * k_per_split
    k_hi = tl.minimum(k, k_lo + k_per_split)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    poison = 0.0  # (NaN where the interpreter finds a prefetched line past the weight)
    if PREFETCH_LINES > 0:  # channels and values past the slice clamped to its last
        line_k = tl.minimum(k_lo + 128 * tl.arange(0, PREFETCH_LINES), k_hi - 1)
        lines = tl.minimum(offs_n, n - 1)[:, None].to(tl.int64) * stride_w + line_k[None, :]
        poison = prefetch_l2(wq_ptr, lines, (n - 1).to(tl.int64) * stride_w + k, ASM)
    pdl_wait(PDL)
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < rows
    mask_n = offs_n < n
    if INT8:  # exact integer sums
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.int32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32) + poison
    for start in range(k_lo, k_hi, BLOCK_K):
        mask_k = start + offs_k < k_hi
        a = tl.load(
            xq_ptr + offs_m[:, None] * stride_x + start + offs_k[None, :],
            mask=mask_m[:, None] & mask_k[None, :], other=0.0,
        )  # fmt: skip
        b = tl.load(
            wq_ptr + offs_n[:, None].to(tl.int64) * stride_w + start + offs_k[None, :],
            mask=mask_n[:, None] & mask_k[None, :], other=0.0,
        )  # fmt: skip
        if INT8:  # (triton 3.6's dot takes a float32 accumulator unless told)
            acc = tl.dot(a, tl.trans(b), acc, out_dtype=tl.int32)
        elif BLOCK_M >= 64:  # a 64-row tile's FP8 wgmma: partial sums promoted every PROMOTE
            acc = tl.dot(a, tl.trans(b), acc, max_num_imprecise_acc=PROMOTE)
        else:  # (16-32 rows: the GPU-measured kernel as it was, exact)
            acc = tl.dot(a, tl.trans(b), acc)
    mask = mask_m[:, None] & mask_n[None, :]
    if SPLIT:  # the slice's sums [splits, rows, n] (int32 or float32), scaled when summed:
        part = offs_m[:, None] * n + offs_n[None, :]  # by _scale_product_kernel or, SERIAL, the last program
        tl.store(part_ptr + pid_s.to(tl.int64) * rows * n + part, acc, mask=mask)
        if SERIAL:  # noqa: SIM102 (a constexpr: the atomic only where it is compiled in)
            if last_of_splits(counters_ptr + pid, tl.num_programs(1)):
                acc = sum_partials(part_ptr, part, mask, rows * n, tl.num_programs(1))
                _store_scaled(out_ptr, acc, xs_ptr, ws_ptr, offs_m, offs_n, mask_m, mask_n, stride_out)
    else:
        _store_scaled(out_ptr, acc, xs_ptr, ws_ptr, offs_m, offs_n, mask_m, mask_n, stride_out)


@triton.jit
def _store_scaled(out_ptr, acc, xs_ptr, ws_ptr, offs_m, offs_n, mask_m, mask_n, stride_out):
    """out = the sums acc times x_scale (per row) and w_scale (per channel), in out's dtype."""
    xs = tl.load(xs_ptr + offs_m, mask=mask_m, other=0.0)
    ws = tl.load(ws_ptr + offs_n, mask=mask_n, other=0.0)
    out = acc.to(tl.float32) * xs[:, None] * ws[None, :]
    tl.store(
        out_ptr + offs_m[:, None] * stride_out + offs_n[None, :],
        out.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :],
    )  # fmt: skip


def fp8_gemm_rows(
    xq: torch.Tensor,
    x_scale: torch.Tensor,
    wq: torch.Tensor,
    w_scale: torch.Tensor,
    out_dtype: torch.dtype = torch.bfloat16,
    block_n: int | None = None,
    block_k: int | None = None,
    splits: int | None = None,
) -> torch.Tensor:
    """xq [M <= MAX_ROWS, K] and wq [N, K] in float8_e4m3fn or int8 (int32 sums; under the
    interpreter also any float dtype), x_scale [M, 1] and w_scale [1, N] float32 -> [M, N] in
    out_dtype. splits: K in that many slices of whole tiles, their sums added (in order, in
    int32 for int8) and scaled by the last program of each tile (SERIAL_SPLITS) or one more
    kernel; None: by SPLIT_BELOW."""
    rows, k, n = scaled_operand_sizes(xq, wq)
    if rows > MAX_ROWS:
        raise ValueError(f"xq has {rows} rows; this kernel takes at most {MAX_ROWS}")
    if xq.dtype != wq.dtype:
        raise ValueError(f"xq and wq must share a dtype, got {xq.dtype} and {wq.dtype}")
    check_scales(xq, x_scale, wq, w_scale)
    check_at_least("splits", splits, 1)
    out = torch.empty((rows, n), dtype=out_dtype, device=xq.device)
    if rows and n:
        # measured on the H200 at 1-16 rows (Llama-3-8B's projections): 64 channels per
        # program; K in tiles of 512, or of 128 when there are hundreds of programs. At 17-32
        # rows the cap below halves K's tile to 256 (tested that way; 512 measured faster there
        # in a sweep, e.g. the down projection 29 vs 41 us, and is worth testing next)
        # in rows' own tiles: FP8's one row in a 64-row tile (Hopper's FP8 wgmma, where the 16-row
        # tile's mma converts both operands to float16: 256 F2FP of 503 sm_90 instructions a step,
        # scripts/sass_loop.py fp8) took 4.04 ms/token against 3.78 on an H100 (session 43)
        block_m = max(16, triton.next_power_of_2(rows))
        block_n = block_n or 64
        if block_k is None:  # given ones are used as they are (scripts/fp8_kernels.py sweeps)
            block_k = 128 if triton.cdiv(n, block_n) >= 256 else 512
            # four pipeline stages of both tiles fit the SM's shared memory (H100/H200: 228 KiB)
            while (
                block_m + block_n
            ) * block_k * xq.element_size() * 4 > 160 * 1024 and block_k > 32:
                block_k //= 2
        tiles, steps = triton.cdiv(n, block_n), triton.cdiv(k, block_k)
        if splits is None:  # SPLIT_BELOW tiles or fewer split K for the SMs
            splits = SPLITS if tiles <= SPLIT_BELOW else 1
        splits, per_split = split_steps(steps, splits)
        xs, ws = x_scale.float(), w_scale.float()
        part, counters = out, None
        if splits > 1:
            part = torch.empty(splits, rows, n, device=xq.device,
                               dtype=torch.int32 if xq.dtype == torch.int8 else torch.float32)  # fmt: skip
            counters = serial_counters(xq.device, tiles)  # (or the last program sums and scales)
        _fp8_gemm_rows_kernel[(tiles, splits)](
            out, part, xq, xs, wq, ws, out if counters is None else counters,
            rows, n, k, per_split * block_k, xq.stride(0), wq.stride(0), out.stride(0),
            BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, INT8=xq.dtype == torch.int8,
            SPLIT=splits > 1, PROMOTE=min(PROMOTE_EVERY, block_k), SERIAL=counters is not None,
            PREFETCH_LINES=prefetch_count(min(PREFETCH_STEPS, per_split) * block_k // 128),
            ASM=not triton.knobs.runtime.interpret, num_warps=4, num_stages=4, **pdl_launch(xq.device),
        )  # fmt: skip
        if splits > 1 and counters is None:
            _scale(out, part, xs, ws)
    return out


# FP8's one row on dense_gemv.scaled_gemv (the weights' bytes streamed by plain loads, float32 sums,
# as bf16's one-row products since session 40) instead of the tensor-core tiles above, whose 16-row
# mma converts both float8 operands to float16 (scripts/sass_loop.py fp8). At its tiling of
# session 42 (dense_gemv.SCALED_TILING: 2 channels, 2,048 a step, 4 warps) on an H100 (session 43,
# `scripts/ab_switch.py mmserve.kernels.fp8_gemm.ONE_ROW_GEMV=True|False -- latency --model
# shape:llama3-8b --load-format dummy --input-len 128 --output-len 128 --max-num-seqs 1
# --quantization fp8`, three pairs): 3.674-3.676 ms/token against 3.777-3.779; on the H200 alone
# (session 42, scripts/sweep_dense_gemv.py --fp8) a layer's four products 67.45 us against the rows
# kernel's 71.92; the H200's engine has not run this tiling yet (at session 41's, 4,096 a step at
# 8 warps: 3.656 against 3.151). INT8 keeps the rows kernel (IMMA, no conversions): 3.649 against
# 3.636 on the same H100, 3.628 against 2.957 on the H200 at the old tiling
ONE_ROW_GEMV = True


def few_rows_product(
    xq: torch.Tensor, x_scale: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor, out_dtype: torch.dtype
) -> torch.Tensor:
    """fp8_gemm_rows's product, FP8's one row by dense_gemv.scaled_gemv where ONE_ROW_GEMV says so."""
    if xq.shape[0] == 1 and ONE_ROW_GEMV and xq.dtype != torch.int8:
        from mmserve.kernels.dense_gemv import scaled_gemv

        return scaled_gemv(xq, x_scale, wq, w_scale, out_dtype)
    return fp8_gemm_rows(xq, x_scale, wq, w_scale, out_dtype)


@triton.jit
def _scale_product_kernel(
    out_ptr, acc_ptr, xs_ptr, ws_ptr, n, splits, stride_split, stride_acc, stride_out,
    BLOCK_N: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """out[m] = (the sum over s of acc[s, m], in order, in acc's dtype) * xs[m] * ws: a
    product's sums (one split) or the slices of a product whose K was split."""
    pdl_wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = offs < n
    acc = tl.load(acc_ptr + row * stride_acc + offs, mask=mask, other=0)
    for s in range(1, splits):
        acc += tl.load(acc_ptr + s * stride_split + row * stride_acc + offs, mask=mask, other=0)
    ws = tl.load(ws_ptr + offs, mask=mask, other=0.0)
    out = acc.to(tl.float32) * tl.load(xs_ptr + row) * ws
    tl.store(out_ptr + row * stride_out + offs, out.to(out_ptr.dtype.element_ty), mask=mask)


def _scale(out: torch.Tensor, acc: torch.Tensor, xs: torch.Tensor, ws: torch.Tensor) -> torch.Tensor:
    """out [M, N] = acc's sums ([M, N], or [splits, M, N]) scaled by xs [M, 1] and ws [1, N]."""
    rows, n = out.shape
    part = acc if acc.dim() == 3 else acc.unsqueeze(0)
    block_n = min(1024, triton.next_power_of_2(n))
    _scale_product_kernel[(rows, triton.cdiv(n, block_n))](
        out, part, xs.float().contiguous(), ws.float().contiguous(), n, part.shape[0],
        part.stride(0), part.stride(1), out.stride(0), BLOCK_N=block_n, **pdl_launch(out.device),
    )  # fmt: skip
    return out


def scale_product(
    acc: torch.Tensor, x_scale: torch.Tensor, w_scale: torch.Tensor, out_dtype: torch.dtype
) -> torch.Tensor:
    """An int32 product [M, N] (torch._int_mm's) times x_scale [M, 1] and w_scale [1, N]
    (float32), in out_dtype: one pass, where torch takes four (to float, two products, cast)."""
    if acc.dim() != 2 or acc.dtype != torch.int32:
        raise ValueError(f"acc must be int32 [M, N], got {acc.dtype} {list(acc.shape)}")
    rows, n = acc.shape
    check_shape("x_scale", x_scale, (rows, 1))
    check_shape("w_scale", w_scale, (1, n))
    check_last_dim_contiguous("acc", acc)
    check_same_device(acc=acc, x_scale=x_scale, w_scale=w_scale)
    out = torch.empty((rows, n), dtype=out_dtype, device=acc.device)
    return _scale(out, acc, x_scale, w_scale) if rows and n else out


def fp8_gemm_rows_ref(
    xq: torch.Tensor, x_scale: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor
) -> torch.Tensor:
    """float32 [M, N]: the torch reference, and the CPU path of mmserve.models.fp8.Fp8Linear."""
    return (xq.float() @ wq.float().t()) * x_scale.float() * w_scale.float()
