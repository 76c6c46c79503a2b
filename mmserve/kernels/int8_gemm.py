"""INT8 x INT8 products of many rows (prefill, large batches) with the scales in the epilogue:
out = (xq @ wq^T) * x_scale * w_scale, xq [M, K] and wq [N, K] int8, the sums exact in int32,
x_scale [M, 1] and w_scale [1, N] float32, out in the model dtype.

torch._int_mm (the other way, models/int8.py) writes its int32 sums to memory and a second
kernel (fp8_gemm.scale_product) reads them back to scale them: 6 bytes of traffic per output
element on top of the product, about a sixth of a Llama-3-8B projection's time at 8k rows, and
on the H200 its kernels are cutlass's sm80 ones. This kernel keeps the sums in registers and
writes the scaled output once. Programs take output tiles in groups of GROUP_M row tiles per
column of tiles (the tiles a group shares stay in L2); both operands are read K-contiguous,
the layout the 8-bit tensor-core instructions want. Under the interpreter (CI) it is tested
exactly against int64 sums; its speed against torch._int_mm is measured by
scripts/bench_int8_gemm.py on the GPU, which decides models/int8.py's LARGE_GEMM.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from mmserve.kernels._common import check_scales, scaled_operand_sizes


@triton.jit
def _int8_gemm_kernel(
    out_ptr, a_ptr, a_scale_ptr, b_ptr, b_scale_ptr, m, n, k, stride_a, stride_b, stride_out,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(m, BLOCK_M)
    tiles_n = tl.cdiv(n, BLOCK_N)
    in_group = GROUP_M * tiles_n
    first_m = (pid // in_group) * GROUP_M
    group_m = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % in_group) % group_m
    pid_n = (pid % in_group) // group_m
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    # rows past the end read row 0 (in bounds; their results are not stored): no masks on M, N
    rows_a = tl.where(offs_m < m, offs_m, 0).to(tl.int64)
    rows_b = tl.where(offs_n < n, offs_n, 0).to(tl.int64)
    a_ptrs = a_ptr + rows_a[:, None] * stride_a + offs_k[None, :]
    b_ptrs = b_ptr + rows_b[None, :] * stride_b + offs_k[:, None]  # [BLOCK_K, BLOCK_N], K-contiguous
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.int32)
    for start in range(0, k, BLOCK_K):
        mask_k = offs_k < k - start
        a = tl.load(a_ptrs, mask=mask_k[None, :], other=0)
        b = tl.load(b_ptrs, mask=mask_k[:, None], other=0)
        acc = tl.dot(a, b, acc, out_dtype=tl.int32)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    a_scale = tl.load(a_scale_ptr + rows_a)
    b_scale = tl.load(b_scale_ptr + rows_b)
    out = acc.to(tl.float32) * a_scale[:, None] * b_scale[None, :]
    tl.store(
        out_ptr + offs_m[:, None].to(tl.int64) * stride_out + offs_n[None, :],
        out.to(out_ptr.dtype.element_ty), mask=(offs_m < m)[:, None] & (offs_n < n)[None, :],
    )  # fmt: skip


@dataclass(frozen=True)
class Int8Tiling:
    block_m: int
    block_n: int
    block_k: int
    group_m: int
    num_warps: int
    num_stages: int


def choose_tiling(rows: int) -> Int8Tiling:
    """128 x 128 output tiles with K steps of 128, 4 warps and 3 stages, 64-row tiles for fewer
    than 128 rows. On the H200 (scripts/bench_int8_gemm.py, session 13, 4096 rows of the 8B
    shape's projections) this tiling made 1,134-1,257 TOP/s, the best of the sweep; 8 warps
    and 4 stages 867-947, 256-wide tiles with 4 warps 230-317 (spilled); torch._int_mm plus
    its scaling pass 734-875, bf16 torch.matmul 700-727."""
    block_m = 64 if rows < 128 else 128
    return Int8Tiling(block_m, 128, 128, 8, 4, 3 if block_m == 128 else 4)


def int8_gemm(
    xq: torch.Tensor,
    x_scale: torch.Tensor,
    wq: torch.Tensor,
    w_scale: torch.Tensor,
    out_dtype: torch.dtype = torch.bfloat16,
    tiling: Int8Tiling | None = None,
) -> torch.Tensor:
    """xq [M, K] and wq [N, K] int8, x_scale [M, 1] and w_scale [1, N] float32 -> [M, N] in
    out_dtype. tiling: for sweeps."""
    rows, k, n = scaled_operand_sizes(xq, wq)
    if xq.dtype != torch.int8 or wq.dtype != torch.int8:
        raise ValueError(f"xq and wq must be int8, got {xq.dtype} and {wq.dtype}")
    check_scales(xq, x_scale, wq, w_scale)
    out = torch.empty((rows, n), dtype=out_dtype, device=xq.device)
    if rows and n:
        t = tiling or choose_tiling(rows)
        grid = (triton.cdiv(rows, t.block_m) * triton.cdiv(n, t.block_n),)
        _int8_gemm_kernel[grid](
            out, xq, x_scale.float().contiguous(), wq, w_scale.float().contiguous(),
            rows, n, k, xq.stride(0), wq.stride(0), out.stride(0),
            BLOCK_M=t.block_m, BLOCK_N=t.block_n, BLOCK_K=t.block_k, GROUP_M=t.group_m,
            num_warps=t.num_warps, num_stages=t.num_stages,
        )  # fmt: skip
    return out
