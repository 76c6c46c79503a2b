"""out = x @ W^T with W kept in GGUF blocks (mmserve/kernels/gguf_blocks.py): dequantised inside the
product for a few rows, once per call for many.

Up to MAX_ROWS rows (decode steps): each program owns BLOCK_N output channels, streams their
blocks once over K, dequantises each tile in registers (float32, then x's dtype, as a weight
dequantised at load and cast to the model dtype would be) and multiplies on the tensor cores
with the rows padded to 16 or 32, accumulating in float32. The blocks are read once per call:
the bytes a step reads are the file's, a quarter of bf16's for Q4 types.

More rows (prefill, large batches): the weight is dequantised to x's dtype by one kernel and
multiplied by torch.matmul (cuBLAS). That costs one write and one read of the float weight
per call, small next to a product of hundreds of rows, and keeps the large-batch product at
cuBLAS's speed without a tiled kernel of our own. Neither path has been timed on a GPU yet
(both compile for sm_90 and pass the GPU tests): the cut at 32 rows and the 32 x 128 weight
tiles follow mmserve/kernels/fp8_gemm.py's measured choices, untuned here, and K is split for grids
too small for the SMs as the w4a16 kernel's measurements said to (down: 128 tiles over
K = 14,336).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mmserve.kernels._common import (
    check_float,
    check_last_dim_contiguous,
    check_same_device,
    grid_sms,
    k_splits,
    matmul_in_column_chunks,
    sum_splits,
)
from mmserve.kernels.gguf_blocks import (
    KQUANT_PARTS,
    BlockFormat,
    check_blocks,
    dequant_tile,
    gguf_dequantize,
    kquant_part,
    q45k_chunk,
)

FACTORED = True  # Q4_K / Q5_K products scale sums of q x by sub-block (_gguf_kquant_rows_kernel)
MAX_ROWS = 32  # the rows of one tile of the few-rows kernel; more go to gguf_dequantize + matmul
PROGRAMS_PER_SM = 4  # a grid smaller than this many programs per SM splits K (w4a16's measured rule)
# the many-rows path dequantises at most this many weights at a time (64 MiB of bf16), so a
# large LM head (128k x 4k) does not need a float copy of itself for one call
CHUNK_ELEMENTS = 1 << 25


@triton.jit
def _gguf_gemm_rows_kernel(
    out_ptr, x_ptr, w_ptr, rows, n, k, k_per_split, row_bytes, stride_x, stride_out,
    QTYPE: tl.constexpr, BYTES: tl.constexpr, QS: tl.constexpr, QH: tl.constexpr,
    MIN: tl.constexpr, ZERO: tl.constexpr, IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr,
):  # fmt: skip
    pid_s = tl.program_id(1)  # this program's slice of K, whole tiles: [k_lo, k_hi)
    k_lo = pid_s * k_per_split
    k_hi = tl.minimum(k, k_lo + k_per_split)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < rows
    mask_n = offs_n < n
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for start in range(k_lo, k_hi, BLOCK_K):
        mask_k = start + offs_k < k_hi
        a = tl.load(
            x_ptr + offs_m[:, None] * stride_x + start + offs_k[None, :],
            mask=mask_m[:, None] & mask_k[None, :], other=0.0,
        )  # fmt: skip
        w_mask = mask_n[:, None] & mask_k[None, :]
        w = dequant_tile(
            w_ptr, offs_n, start + offs_k, w_mask, row_bytes, QTYPE, BYTES, QS, QH, MIN, ZERO
        ).to(a.dtype)
        if IEEE:  # float32 activations: no TF32 rounding of either operand
            acc = tl.dot(a, tl.trans(w), acc, input_precision="ieee")
        else:
            acc = tl.dot(a, tl.trans(w), acc)
    out_offs = offs_m[:, None] * stride_out + offs_n[None, :]
    if SPLIT:  # float32 partials [splits, rows, n], summed in order by _common.sum_splits
        out_offs += pid_s.to(tl.int64) * rows * n
    tl.store(out_ptr + out_offs, acc.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


@triton.jit
def _gguf_kquant_rows_kernel(
    out_ptr, x_ptr, w_ptr, rows, n, blocks_per_split, num_blocks, row_bytes, stride_x, stride_out,
    QTYPE: tl.constexpr, BYTES: tl.constexpr, PARTS: tl.constexpr, IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, FACTORED: tl.constexpr,
):  # fmt: skip
    """_gguf_gemm_rows_kernel for the K-quants: K walked a super-block at a time, each read
    part by part (gguf_blocks.kquant_part) and multiplied with the activations of its
    columns. FACTORED (Q4_K / Q5_K): the quants themselves multiply the activations, a
    sub-block at a time, and its factors scale the sums: sum (d1 q - m1) x = d1 sum q x -
    m1 sum x (gguf_blocks.q45k_chunk)."""
    pid_s = tl.program_id(1)  # this program's super-blocks: [sb_lo, sb_hi)
    sb_lo = pid_s * blocks_per_split
    sb_hi = tl.minimum(num_blocks, sb_lo + blocks_per_split)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < rows
    mask_n = offs_n < n
    row = w_ptr + tl.where(mask_n, offs_n, 0).to(tl.int64) * row_bytes  # past n: row 0's bytes
    x_rows = x_ptr + offs_m[:, None] * stride_x
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    j = tl.arange(0, 32)
    for sb in range(sb_lo, sb_hi):
        if FACTORED:
            for c in tl.static_range(4):
                q_lo, q_hi, d1_lo, m1_lo, d1_hi, m1_hi = q45k_chunk(row + sb * BYTES, c, QTYPE)
                x_lo = tl.load(x_rows + sb * 256 + 64 * c + j[None, :], mask=mask_m[:, None], other=0.0)
                x_hi = tl.load(x_rows + sb * 256 + 64 * c + 32 + j[None, :], mask=mask_m[:, None], other=0.0)
                if IEEE:  # float32 activations: no TF32 rounding of either operand
                    s_lo = tl.dot(x_lo, tl.trans(q_lo.to(x_lo.dtype)), input_precision="ieee")
                    s_hi = tl.dot(x_hi, tl.trans(q_hi.to(x_hi.dtype)), input_precision="ieee")
                else:
                    s_lo = tl.dot(x_lo, tl.trans(q_lo.to(x_lo.dtype)))
                    s_hi = tl.dot(x_hi, tl.trans(q_hi.to(x_hi.dtype)))
                acc += d1_lo[None, :] * s_lo + d1_hi[None, :] * s_hi
                acc -= m1_lo[None, :] * tl.sum(x_lo.to(tl.float32), axis=1)[:, None]
                acc -= m1_hi[None, :] * tl.sum(x_hi.to(tl.float32), axis=1)[:, None]
        else:
            for part in tl.static_range(PARTS):
                w, cols = kquant_part(row + sb * BYTES, part, QTYPE, BLOCK_N)
                a = tl.load(x_rows + sb * 256 + cols[None, :], mask=mask_m[:, None], other=0.0)
                if IEEE:  # float32 activations: no TF32 rounding of either operand
                    acc = tl.dot(a, tl.trans(w.to(a.dtype)), acc, input_precision="ieee")
                else:
                    acc = tl.dot(a, tl.trans(w.to(a.dtype)), acc)
    out_offs = offs_m[:, None] * stride_out + offs_n[None, :]
    if SPLIT:  # float32 partials [splits, rows, n], summed in order by _common.sum_splits
        out_offs += pid_s.to(tl.int64) * rows * n
    tl.store(out_ptr + out_offs, acc.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


def gguf_gemm_rows(
    x: torch.Tensor, blocks: torch.Tensor, qtype: str, block_n: int = 32, block_k: int = 128,
    programs_per_sm: int | None = None,
) -> torch.Tensor:  # fmt: skip
    """x [M <= 32, K] (float32/float16/bfloat16) @ the qtype weight in blocks [N, K // e, bytes]
    transposed -> [M, N] in x's dtype. block_k: a power of two >= 32 (a partial K tile is
    masked; tiles need not hold whole super-blocks). A grid of too few output tiles for about
    programs_per_sm (default PROGRAMS_PER_SM) programs on every SM splits K, as the w4a16
    kernel does (mmserve/kernels/_common.k_splits); 0 never splits."""
    fmt = check_blocks("blocks", blocks, qtype)
    check_float("x", x)
    if x.dim() != 2 or x.shape[1] != blocks.shape[1] * fmt.elements:
        raise ValueError(
            f"x must be [M, K] with K = {blocks.shape[1] * fmt.elements} (blocks "
            f"{list(blocks.shape)} of {qtype}), got {list(x.shape)}"
        )
    rows, k = x.shape
    if rows > MAX_ROWS:
        raise ValueError(f"x has {rows} rows; this kernel takes at most {MAX_ROWS}")
    if block_k < 32 or block_k & (block_k - 1) or block_n < 16 or block_n & (block_n - 1):
        raise ValueError(
            f"block_n (>= 16) and block_k (>= 32) must be powers of two, got {block_n}, {block_k}"
        )
    check_last_dim_contiguous("x", x)
    check_same_device(x=x, blocks=blocks)
    n = blocks.shape[0]
    out = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    if rows and n and fmt.type_id in KQUANT_PARTS:
        _kquant_rows(out, x, blocks, fmt, block_n, programs_per_sm)
    elif rows and n:
        tiles = triton.cdiv(n, block_n)
        programs = PROGRAMS_PER_SM if programs_per_sm is None else programs_per_sm
        splits, per_split = k_splits(tiles, triton.cdiv(k, block_k), grid_sms(x.device), programs)
        target = torch.empty(splits, rows, n, dtype=torch.float32, device=x.device) if splits > 1 else out
        _gguf_gemm_rows_kernel[(tiles, splits)](
            target, x, blocks, rows, n, k, per_split * block_k, blocks.shape[1] * fmt.bytes, x.stride(0),
            n if splits > 1 else out.stride(0), **fmt.kernel_args(), IEEE=x.dtype == torch.float32,
            BLOCK_M=max(16, triton.next_power_of_2(rows)), BLOCK_N=block_n, BLOCK_K=block_k,
            SPLIT=splits > 1, num_warps=4,
        )  # fmt: skip
        if splits > 1:
            sum_splits(out, target)
    return out


def _kquant_rows(
    out: torch.Tensor, x: torch.Tensor, blocks: torch.Tensor, fmt: BlockFormat, block_n: int,
    programs_per_sm: int | None, factored: bool | None = None,
) -> None:  # fmt: skip
    """gguf_gemm_rows' launch for the K-quants: K split in whole super-blocks."""
    rows, n, num_blocks = x.shape[0], blocks.shape[0], blocks.shape[1]
    tiles = triton.cdiv(n, block_n)
    programs = PROGRAMS_PER_SM if programs_per_sm is None else programs_per_sm
    splits, per_split = k_splits(tiles, num_blocks, grid_sms(x.device), programs)
    target = torch.empty(splits, rows, n, dtype=torch.float32, device=x.device) if splits > 1 else out
    _gguf_kquant_rows_kernel[(tiles, splits)](
        target, x, blocks, rows, n, per_split, num_blocks, num_blocks * fmt.bytes, x.stride(0),
        n if splits > 1 else out.stride(0), QTYPE=fmt.type_id, BYTES=fmt.bytes,
        PARTS=KQUANT_PARTS[fmt.type_id], IEEE=x.dtype == torch.float32,
        BLOCK_M=max(16, triton.next_power_of_2(rows)), BLOCK_N=block_n, SPLIT=splits > 1,
        FACTORED=(FACTORED if factored is None else factored) and fmt.type_id != 14, num_warps=4,
    )  # fmt: skip
    if splits > 1:
        sum_splits(out, target)


def gguf_matmul(
    x: torch.Tensor, blocks: torch.Tensor, qtype: str, chunk_elements: int = CHUNK_ELEMENTS
) -> torch.Tensor:
    """x [M, K] @ W^T -> [M, N] in x's dtype, W the qtype weight in blocks: the few-rows kernel
    up to MAX_ROWS rows, else W dequantised to x's dtype (chunk_elements at a time) and
    torch.matmul."""
    if x.dim() == 2 and x.shape[0] <= MAX_ROWS:
        return gguf_gemm_rows(x, blocks, qtype)
    fmt = check_blocks("blocks", blocks, qtype)
    check_float("x", x)
    k = blocks.shape[1] * fmt.elements
    if x.dim() != 2 or x.shape[1] != k:
        raise ValueError(f"x must be [M, K] with K = {k}, got {list(x.shape)}")
    return matmul_in_column_chunks(
        x, blocks.shape[0], chunk_elements, lambda cols: gguf_dequantize(blocks[cols], qtype, x.dtype).t()
    )


def gguf_matmul_ref(x: torch.Tensor, blocks: torch.Tensor, qtype: str) -> torch.Tensor:
    """float32 [M, N]: x @ W^T with W from the gguf package's dequantiser."""
    from mmserve.kernels.gguf_blocks import gguf_dequantize_ref

    return x.float() @ gguf_dequantize_ref(blocks, qtype).t()
