"""out = x @ W^T with W kept in GGUF blocks (mmserve/kernels/gguf_blocks.py): dequantised inside the
product for a few rows, once per call for many.

Up to MAX_ROWS rows (decode steps): each program owns BLOCK_N output channels and streams their
blocks once over K, a step of 256 elements at a time (gguf_blocks.step_part: each byte loaded
once, in runs along the blocks). Each part of a step is dequantised in registers (float32, then
x's dtype, as a weight dequantised at load and cast to the model dtype would be) and multiplied
on the tensor cores with the rows padded to 16 (LOWP: the weights are the product's M side and
the rows pad to 8), accumulating in float32. Q4_K and Q5_K
(FACTORED) multiply the quants themselves, a 32-element sub-block at a time, and scale the
sums: sum (d1 q - m1) x = d1 sum q x - m1 sum x, fewer operations per weight. The bytes a step
reads are the file's: for Q4_K about 0.28 of bf16's. K is split for grids too small for the
SMs, as the w4a16 kernel's measurements said to.

More rows (prefill, large batches): the weight is dequantised to x's dtype by one kernel and
multiplied by torch.matmul (cuBLAS). That costs one write and one read of the float weight
per call, small next to a product of hundreds of rows, and keeps the large-batch product at
cuBLAS's speed without a tiled kernel of our own. scripts/bench_gguf.py times both paths.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mmserve.kernels._common import (
    check_float,
    check_last_dim_contiguous,
    check_same_device,
    dp4a,
    finish_splits,
    grid_sms,
    int8_activations_ref,
    k_splits,
    matmul_in_column_chunks,
    pdl_launch,
    pdl_wait,
    split_target,
    store_args,
    store_tile,
)
from mmserve.kernels.gguf_blocks import (
    STEP,
    STEP_PARTS,
    check_weight,
    f16_at,
    gguf_dequantize,
    lowp_args,
    q6k_bytes,
    q6k_quarter_lowp,
    q6k_step_words,
    q8_step,
    q45k_chunk,
    q45k_step_lowp,
    q45k_step_words,
    q45k_words_factors,
    step_part,
)
from mmserve.kernels.gguf_planes import is_planes, q6k_fields

# Measured on an H100 (session 20, scripts/bench_gguf.py; BENCHMARKS.md): at one row of the
# 4096 x 14336 Q4_K down projection, 64 channels a program and the factored form took 53 us,
# the dequantised form 56-58 (32 channels: 66-81). From 32 rows on, dequantise-then-cuBLAS beat
# the few-rows kernel at every 8B shape (e.g. Q4_K 28672 x 4096: 207 against 254 us).
FACTORED = True  # Q4_K / Q5_K products scale sums of q x by sub-block (q45k_chunk)
BLOCK_N = 64  # output channels per program of the few-rows kernel
# One row by _gguf_gemv_kernel (FMAs into a register accumulator) instead of the tensor-core
# kernel. Timed on an H100 (session 22) against LOWP at one row: faster for Q6_K's LM head
# (261 against 281 us) and 28672 x 4096 (68 against 75), slower for every Q4_K and Q5_K shape
# (e.g. Q4_K 28672 x 4096: 76 against 64; Q5_K down: 57 against 45): off
GEMV = False
# The K-quants dequantised in x's 16-bit dtype (gguf_blocks' LOWP: bfloat16 quants by bits on
# CUDA): about 5 instructions a weight in the sm_90 SASS of the loop against 7.4-11.3. On an
# H100 (session 22) its bf16 products and dequantiser are within bf16 rounding of the float32
# ones, and at one row of the 8B shapes it took 19-64 us for Q4_K against the factored form's
# 21-97; the Q4_K_M 8B decode step went from 7.43 to 5.74 ms at batch 1 and from 8.59 to 6.83
# at batch 16 (bf16 in the same run: 6.06 and 7.03)
LOWP = True
LOWP_WORDS = True  # Q4_K's / Q5_K's scales read as 32-bit words (gguf_blocks.q45k_words_factors)
# One row of Q4_K / Q5_K by _gguf_dp4a_kernel: the activations quantised to int8 by 32 inside it
# (ggml's q8_1) and multiplied with the quants as words of four bytes by dp4a: in the sm_90 SASS
# of the loop (scripts/sass_loop.py, Triton 3.6, 128 channels) 2.07 instructions a weight for
# Q4_K against LOWP words' 3.84 (Q5_K 2.54 against 5.22). Adds the activations' rounding to int8
# (ggml's CUDA backend does the same by default), so only for 16-bit activations: float32 keeps
# the exact product. Session 23, one row, 64 channels a program: on an H200 Q4_K's 28672 x 4096
# took 31 us against LOWP words' 65 (bf16: 57) and 4096 x 14336 21 against 42 (bf16: 32), Q5_K's
# 23 against 45; the Q4_K_M 8B decode went from 5.68 to 3.68 ms a token (bf16: 4.69), on an H100
# from 5.78 to 3.84 (bf16: 6.27). The rounding's cost on SmolLM2's weights (bench quality's
# float32+q8, every position): KL 0.0019 nats from float32, about w8a16-g64's
DP4A = True
# Q6_K's kernel (dp4a=True) is slower than LOWP (H100: 29 against 20 us at 6144 x 4096, 418 against
# 281 at the LM head): its 210-byte blocks are read 16 bits at a time. Not by default
DP4A_TYPES = ("Q4_K", "Q5_K")
# Q6_K weights repacked at load on CUDA into planes (mmserve.kernels.gguf_planes: the same bytes,
# each field 16-byte aligned; mmserve.models.gguf_linear) and their products of up to
# DP4A_MAX_ROWS rows by that kernel in its PLANES form (its quants loaded as words, 16 bytes at a
# time). Every other product (LOWP at more rows, dequantise-then-matmul) reads the planes as it
# reads blocks. On since session 28 (H200, `scripts/gpu_run.sh q6k`, 8B Q4_K_M, blocks against
# planes): batch-1 latency 3.22 -> 2.99 ms/token, decode step at 1k context 3.27 -> 3.04 ms at one
# row and 4.84 against 4.88 at two; one row of ffn_down 39.1 -> 27.9 us, of the LM head 264 -> 208
Q6K_ALIGNED = True
DP4A_KERNEL_TYPES = (*DP4A_TYPES, "Q6_K")
# Q6_K's kernel with several rows keeps a sum a sub-block (16 floats a channel) for each row, so
# that each row's arithmetic is the one-row kernel's: at 128 channels and 4 warps 16 registers a
# row; with Q6K_ALIGNED on, uses_dp4a gives it up to DP4A_MAX_ROWS rows of planes. In the sm_90
# SASS of the loop (scripts/sass_loop.py, 128 channels, a weight counting all rows) at 2 rows
# 3.23 instructions a weight on planes (7.39 on blocks; 4 rows: 5.27) against LOWP's 7.00 on
# planes and 6.20 on blocks. Counted, not timed
Q6K_DP4A_MAX_ROWS = 4
# the activations quantised by _q8_kernel first (one launch more), not by each program: no
# faster (H200: 31.8 against 31.1 us, 21.3 against 20.8); Q6_K's kernel always takes them so
DP4A_PREQUANT = False
# rows (up to MAX_ROWS) the DP4A kernel takes by default. As a program a row and tile (each row
# repeating the unpacking) it lost past two rows (H100, Q4_K_M 8B decode step, session 24: at 2
# rows 5.78 against LOWP words' 5.90 ms, at 4 8.32 against 6.02, at 16 25.2 against 6.85). Now a
# program unpacks a tile's quants once for all its rows, which take their activations quantised
# first, DP4A_ROWS_BLOCK_N channels a program, the dp4a sums chained: in the sm_90 SASS of the
# loop (scripts/sass_loop.py) 2.52 instructions a weight at 2 rows, 3.85 at 4, 6.5 at 8, against
# LOWP words' 3.84. Decode steps at 1k context (H100, Q4_K_M 8B, session 26), rows 1/2/4/8: LOWP
# words above one row 3.71/5.77/5.93/6.16 ms; DP4A up to 2 rows 3.71/5.20/5.90/6.16; up to 4
# rows 4 took 6.22: up to 2
DP4A_MAX_ROWS = 2
DP4A_ROWS_BLOCK_N = 128
# One row with int8 activations: (channels a program, warps) by type, else (BLOCK_N, 4).
# H100 (session 29, `BENCH_GGUF_QUICK=1 scripts/bench_gguf.py`): Q4_K at the 8B shapes qkv / o /
# gate_up / down took 11.7 / 9.0 / 31.5 / 21.8 us at 32 channels and one warp, against 12.5 /
# 9.6 / 34.0 / 23.8 at 64 and 4 (7% less); Q5_K's down 25.1 against 24.8 (kept). In the engine
# (session 30, H100, Q4_K_M at batch 1) it was slower: latency 3.479 against 3.393 ms/token, the
# decode step 3.554 against 3.464. No type overrides the default.
DP4A_ONE_ROW_TILE: dict[str, tuple[int, int]] = {}
MAX_ROWS = 16  # the rows of the few-rows kernel; more go to gguf_dequantize + matmul
PROGRAMS_PER_SM = 4  # a grid smaller than this many programs per SM splits K (w4a16's measured rule)
# The few-rows kernel's software pipeline (stages of its loop; None: Triton's default, 3). On an
# H100 the LOWP_WORDS down projection at one row took 34.8-34.9 us at 2 stages against 41.6-41.9
# at 3 (sessions 22, 23), and the Q4_K_M 8B decode 5.43 against 5.81 ms at batch 1 but 6.94
# against 6.86 at batch 16 (session 23). One row is DP4A's now, so the default stays
NUM_STAGES: int | None = None
# the many-rows path dequantises at most this many weights at a time (64 MiB of bf16), so a
# large LM head (128k x 4k) does not need a float copy of itself for one call
CHUNK_ELEMENTS = 1 << 25


@triton.jit
def _dot(a, b, acc, IEEE: tl.constexpr):
    """acc + a @ b; float32 operands (IEEE) without TF32 rounding of either."""
    if IEEE:
        return tl.dot(a, b, acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc)


@triton.jit
def _part_dot(acc, x_rows, mask_m, step, w, cols, IEEE: tl.constexpr):
    """acc [BLOCK_N, BLOCK_M] + w [BLOCK_N, len(cols)] @ the activations at the step's columns
    cols, transposed: the weights are the product's M side, so that on Hopper a warpgroup's
    MMA takes 64 channels by 8 rows (a few rows pad to 8, not to 16 as on the N side)."""
    a = tl.load(x_rows + step * 256 + cols[None, :], mask=mask_m[:, None], other=0.0)
    return _dot(w, tl.trans(a), acc, IEEE)


@triton.jit
def _step_product(
    acc, x_rows, mask_m, row, step, num_blocks, j,
    QTYPE: tl.constexpr, BYTES: tl.constexpr, QS: tl.constexpr, QH: tl.constexpr,
    MIN: tl.constexpr, ZERO: tl.constexpr, PARTS: tl.constexpr, IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, FACTORED: tl.constexpr, LOWP: tl.constexpr,
    ASM: tl.constexpr, WORDS: tl.constexpr, PLANES: tl.constexpr,
):  # fmt: skip
    """acc plus the product of the activations with one step (256 elements of K) of the rows
    (PLANES: Q6_K in planes, gguf_planes)."""
    if LOWP:  # the K-quants dequantised in x's dtype (gguf_blocks' LOWP)
        block = row + step * BYTES
        dtype = x_rows.dtype.element_ty
        if QTYPE != 14:  # Q4_K / Q5_K
            w_lo, cols_lo, w_hi, cols_hi = q45k_step_lowp(block, QTYPE, dtype, ASM, WORDS, BLOCK_N)
            acc = _part_dot(acc, x_rows, mask_m, step, w_lo, cols_lo, IEEE)
            acc = _part_dot(acc, x_rows, mask_m, step, w_hi, cols_hi, IEEE)
        else:  # Q6_K
            base, ql_at, qh_at, sc_at, d_at = q6k_fields(row, step, num_blocks, PLANES)
            ql_even, ql_odd, qh = q6k_bytes(base, ql_at, qh_at)
            for quarter in tl.static_range(4):
                w, cols = q6k_quarter_lowp(base, sc_at, d_at, ql_even, ql_odd, qh, quarter, dtype, ASM, BLOCK_N)
                acc = _part_dot(acc, x_rows, mask_m, step, w, cols, IEEE)
    elif FACTORED:  # Q4_K / Q5_K: chunk c's two sub-blocks of 32
        for c in tl.static_range(4):
            q_lo, q_hi, d1_lo, m1_lo, d1_hi, m1_hi = q45k_chunk(row + step * BYTES, c, QTYPE)
            at = x_rows + step * 256 + 64 * c + j[None, :]
            x_lo = tl.load(at, mask=mask_m[:, None], other=0.0)
            x_hi = tl.load(at + 32, mask=mask_m[:, None], other=0.0)
            zeros = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            sum_lo = _dot(x_lo, tl.trans(q_lo.to(x_lo.dtype)), zeros, IEEE)
            sum_hi = _dot(x_hi, tl.trans(q_hi.to(x_hi.dtype)), zeros, IEEE)
            acc += d1_lo[None, :] * sum_lo + d1_hi[None, :] * sum_hi
            acc -= m1_lo[None, :] * tl.sum(x_lo.to(tl.float32), axis=1)[:, None]
            acc -= m1_hi[None, :] * tl.sum(x_hi.to(tl.float32), axis=1)[:, None]
    else:
        for part in tl.static_range(PARTS):
            w, cols, exists = step_part(row, step, num_blocks, part, QTYPE, BYTES, QS, QH, MIN, ZERO, BLOCK_N, PLANES)
            a = tl.load(x_rows + step * 256 + cols[None, :], mask=mask_m[:, None] & exists[None, :], other=0.0)
            acc = _dot(a, tl.trans(w.to(a.dtype)), acc, IEEE)
    return acc


@triton.jit
def _program_slice(w_ptr, tile, n, steps_per_split, num_steps, row_bytes, BLOCK_N: tl.constexpr):
    """This program's steps of K, [s_lo, s_hi), its output channels (those of tile), which of
    them exist, and their rows' byte pointers (past n: row 0's bytes)."""
    s_lo = tl.program_id(1) * steps_per_split
    s_hi = tl.minimum(num_steps, s_lo + steps_per_split)
    offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < n
    row = w_ptr + tl.where(mask_n, offs_n, 0).to(tl.int64) * row_bytes
    return s_lo, s_hi, offs_n, mask_n, row


@triton.jit
def _gguf_gemm_rows_kernel(
    out_ptr, x_ptr, w_ptr, rows, n, num_blocks, steps_per_split, num_steps, row_bytes,
    stride_x, final_ptr, counters_ptr,
    QTYPE: tl.constexpr, BYTES: tl.constexpr, QS: tl.constexpr, QH: tl.constexpr,
    MIN: tl.constexpr, ZERO: tl.constexpr, PARTS: tl.constexpr, IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, FACTORED: tl.constexpr,
    UNROLL: tl.constexpr, LOWP: tl.constexpr, ASM: tl.constexpr, WORDS: tl.constexpr,
    SERIAL: tl.constexpr, PLANES: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    pdl_wait(PDL)
    s_lo, s_hi, offs_n, mask_n, row = _program_slice(w_ptr, tl.program_id(0), n, steps_per_split, num_steps, row_bytes, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    mask_m = offs_m < rows
    x_rows = x_ptr + offs_m[:, None] * stride_x
    # LOWP accumulates the product transposed, [BLOCK_N, BLOCK_M] (_part_dot)
    shape: tl.constexpr = [BLOCK_N, BLOCK_M] if LOWP else [BLOCK_M, BLOCK_N]
    acc = tl.zeros(shape, dtype=tl.float32)
    j = tl.arange(0, 32)
    if UNROLL == 1:
        for step in range(s_lo, s_hi):
            acc = _step_product(
                acc, x_rows, mask_m, row, step, num_blocks, j, QTYPE, BYTES, QS, QH, MIN, ZERO,
                PARTS, IEEE, BLOCK_M, BLOCK_N, FACTORED, LOWP, ASM, WORDS, PLANES,
            )  # fmt: skip
    else:  # UNROLL steps an iteration, none behind a branch (a step past s_hi repeats the last, unused)
        for first in range(s_lo, s_hi, UNROLL):
            for u in tl.static_range(UNROLL):
                part = _step_product(
                    tl.zeros(shape, dtype=tl.float32), x_rows, mask_m, row,
                    tl.minimum(first + u, s_hi - 1), num_blocks, j, QTYPE, BYTES, QS, QH, MIN,
                    ZERO, PARTS, IEEE, BLOCK_M, BLOCK_N, FACTORED, LOWP, ASM, WORDS, PLANES,
                )  # fmt: skip
                acc += tl.where(first + u < s_hi, part, 0.0)
    if LOWP:
        acc = tl.trans(acc)
    offs = offs_m[:, None] * n + offs_n[None, :]  # (out contiguous; SPLIT: float32 partials [splits, rows, n])
    store_tile(out_ptr, acc, offs, mask_m[:, None] & mask_n[None, :], rows * n, final_ptr, counters_ptr, SPLIT, SERIAL)


@triton.jit
def _gguf_gemv_kernel(
    out_ptr, x_ptr, w_ptr, n, num_blocks, steps_per_split, num_steps, row_bytes, final_ptr, counters_ptr,
    QTYPE: tl.constexpr, BYTES: tl.constexpr, QS: tl.constexpr, QH: tl.constexpr,
    MIN: tl.constexpr, ZERO: tl.constexpr, PARTS: tl.constexpr, BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr, SERIAL: tl.constexpr, PLANES: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """One row (GEMV=True): no tensor cores. Each part's weights times the activations of
    its columns are added into a [BLOCK_N, 256 / PARTS] float32 accumulator in registers,
    summed along K once at the end (no per-step reduction or operand layout change)."""
    pdl_wait(PDL)
    s_lo, s_hi, offs_n, mask_n, row = _program_slice(w_ptr, tl.program_id(0), n, steps_per_split, num_steps, row_bytes, BLOCK_N)
    acc = tl.zeros([BLOCK_N, 256 // PARTS], dtype=tl.float32)
    for step in range(s_lo, s_hi):
        for part in tl.static_range(PARTS):
            w, cols, exists = step_part(row, step, num_blocks, part, QTYPE, BYTES, QS, QH, MIN, ZERO, BLOCK_N, PLANES)
            a = tl.load(x_ptr + step * 256 + cols, mask=exists, other=0.0).to(tl.float32)
            acc += w * a[None, :]
    store_tile(out_ptr, tl.sum(acc, axis=1), offs_n, mask_n, n, final_ptr, counters_ptr, SPLIT, SERIAL)


@triton.jit
def _q8_kernel(words_ptr, d_ptr, sum_ptr, x_ptr, stride_x, PDL: tl.constexpr):
    """One step (program_id(0)) of a row (program_id(1)) of activations quantised (q8_step)
    into that row of words [rows, K / 4] (step s's word (c, w, h) at 64 s + 16 c + 8 h + w:
    elements 4 i to 4 i + 3 in word i), scales and sums [rows, K / 32] (group 2 c + h of step s
    at 8 s + 2 c + h)."""
    pdl_wait(PDL)
    step, r = tl.program_id(0), tl.program_id(1)
    words_ptr += r * tl.num_programs(0) * 64
    d_ptr += r * tl.num_programs(0) * 8
    sum_ptr += r * tl.num_programs(0) * 8
    words, d_x, sum_x = q8_step(x_ptr + r.to(tl.int64) * stride_x, step)
    c, w, h = tl.arange(0, 4)[:, None, None], tl.arange(0, 8)[None, :, None], tl.arange(0, 2)[None, None, :]
    tl.store(words_ptr + step * 64 + 16 * c + 8 * h + w, words)
    groups = step * 8 + 2 * tl.arange(0, 4)[:, None] + tl.arange(0, 2)[None, :]
    tl.store(d_ptr + groups, d_x)
    tl.store(sum_ptr + groups, sum_x)


@triton.jit
def _gguf_dp4a_kernel(
    out_ptr, x_ptr, d_ptr, sum_ptr, w_ptr, n, steps_per_split, num_steps, row_bytes, stride_x,
    final_ptr, counters_ptr,
    QTYPE: tl.constexpr, BYTES: tl.constexpr, BLOCK_N: tl.constexpr, ROWS: tl.constexpr,
    SPLIT: tl.constexpr, ASM: tl.constexpr, PREQUANT: tl.constexpr, SERIAL: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    """Q4_K / Q5_K times ROWS rows of x with int8 activations (DP4A): each step's activations
    quantised by 32 (q8_step; or, PREQUANT, read as _q8_kernel wrote them at x_ptr, d_ptr and
    sum_ptr), each sub-block's quants times them summed in int32 by dp4a, then
    scaled: d1 d_x sum(q q_x) - m1 sum(x) per sub-block. One row: into a float32 [BLOCK_N, 4,
    2] accumulator summed once at the end. Several: the step's quants and factors are unpacked
    once for all rows, each row's terms summed per step into its row of a [ROWS, BLOCK_N]
    accumulator."""
    pdl_wait(PDL)
    s_lo, s_hi, offs_n, mask_n, row = _program_slice(w_ptr, tl.program_id(0), n, steps_per_split, num_steps, row_bytes, BLOCK_N)
    ROWS_P2: tl.constexpr = triton.next_power_of_2(ROWS)
    rows_at = tl.arange(0, ROWS_P2)[:, None]
    acc = tl.zeros([BLOCK_N, 4, 2] if ROWS == 1 else [ROWS_P2, BLOCK_N], dtype=tl.float32)
    c, w, h = tl.arange(0, 4)[:, None, None], tl.arange(0, 8)[None, :, None], tl.arange(0, 2)[None, None, :]
    groups = 2 * tl.arange(0, 4)[:, None] + tl.arange(0, 2)[None, :]
    for step in range(s_lo, s_hi):
        block = row + step * BYTES
        q = q45k_step_words(block, QTYPE)
        d1_even, m1_even, d1_odd, m1_odd = q45k_words_factors(block)  # sub-blocks 2 c, then 2 c + 1
        d1, m1 = tl.join(d1_even, d1_odd), tl.join(m1_even, m1_odd)  # [BLOCK_N, 4, 2]
        for r in tl.static_range(ROWS):
            if PREQUANT:  # row r's at r K / 4 words and r K / 32 groups
                at = step if r == 0 else r * num_steps + step  # (row 0: no address arithmetic a step)
                x_words = tl.load(x_ptr + at * 64 + 16 * c + 8 * h + w)
                d_x, sum_x = tl.load(d_ptr + at * 8 + groups), tl.load(sum_ptr + at * 8 + groups)
                terms = _dp4a_terms(q, d1, m1, x_words, d_x, sum_x, ASM, ROWS > 1)
            else:
                x_row = x_ptr if r == 0 else x_ptr + r * stride_x
                terms = _dp4a_terms(q, d1, m1, *q8_step(x_row, step), ASM, ROWS > 1)
            if ROWS == 1:
                acc += terms
            else:
                acc += tl.where(rows_at == r, tl.sum(tl.sum(terms, axis=2), axis=1)[None, :], 0.0)
    # out [ROWS, n] (contiguous), or float32 partials [splits, ROWS, n] when SPLIT
    if ROWS == 1:
        store_tile(out_ptr, tl.sum(tl.sum(acc, axis=2), axis=1), offs_n, mask_n, n, final_ptr, counters_ptr, SPLIT, SERIAL)
    else:
        offs, mask = rows_at * n + offs_n[None, :], (rows_at < ROWS) & mask_n[None, :]
        store_tile(out_ptr, acc, offs, mask, ROWS * n, final_ptr, counters_ptr, SPLIT, SERIAL)


@triton.jit
def _dp4a_terms(q, d1, m1, x_words, d_x, sum_x, ASM: tl.constexpr, CHAIN: tl.constexpr):
    """A Q4_K / Q5_K step's terms for one row, [BLOCK_N, 4, 2] (a sub-block each): d1 d_x
    sum(q q_x) - m1 sum(x), the sums of the quants q times the activations' int8 words x_words
    by dp4a. CHAIN: each dp4a adds into the previous one's result (no separate adds; its
    slicing costs shared-memory round trips: with several rows, 2.52 instructions a weight
    against 2.93 at 2 rows, 3.85 against 4.95 at 4; one row, 64 channels: 342 against 331 a
    step, so not there)."""
    if CHAIN:
        low, high = tl.split(q)  # [BLOCK_N, 4, 8] each: sub-blocks 2 c and 2 c + 1
        x_low, x_high = tl.split(x_words)  # [4, 8]
        dots = tl.join(_chained_dots(low, x_low, ASM), _chained_dots(high, x_high, ASM))
    else:
        dots = tl.sum(dp4a(q, tl.broadcast_to(x_words[None], q.shape), tl.zeros_like(q), ASM), axis=2)
    return d1 * (d_x[None] * dots.to(tl.float32)) - m1 * sum_x[None]


@triton.jit
def _eighths(t):
    """t [..., 8] as its eight [...] slices (the last axis split in halves three times)."""
    a, b = tl.split(tl.reshape(t, t.shape[:-1] + [2, 2, 2]))
    a0, a1 = tl.split(a)
    b0, b1 = tl.split(b)
    a00, a01 = tl.split(a0)
    a10, a11 = tl.split(a1)
    b00, b01 = tl.split(b0)
    b10, b11 = tl.split(b1)
    return a00, a01, a10, a11, b00, b01, b10, b11


@triton.jit
def _chained_dots(q, x_words, ASM: tl.constexpr):
    """sum over the last axis of dp4a(q [BLOCK_N, 4, 8], x_words [4, 8]), each dp4a adding into
    the previous one's result (no separate adds)."""
    q0, q1, q2, q3, q4, q5, q6, q7 = _eighths(q)
    x0, x1, x2, x3, x4, x5, x6, x7 = _eighths(x_words)
    acc = dp4a(q0, tl.broadcast_to(x0[None], q0.shape), tl.zeros_like(q0), ASM)
    acc = dp4a(q1, tl.broadcast_to(x1[None], q1.shape), acc, ASM)
    acc = dp4a(q2, tl.broadcast_to(x2[None], q2.shape), acc, ASM)
    acc = dp4a(q3, tl.broadcast_to(x3[None], q3.shape), acc, ASM)
    acc = dp4a(q4, tl.broadcast_to(x4[None], q4.shape), acc, ASM)
    acc = dp4a(q5, tl.broadcast_to(x5[None], q5.shape), acc, ASM)
    acc = dp4a(q6, tl.broadcast_to(x6[None], q6.shape), acc, ASM)
    return dp4a(q7, tl.broadcast_to(x7[None], q7.shape), acc, ASM)


@triton.jit
def _gguf_q6k_dp4a_kernel(
    out_ptr, x_ptr, d_ptr, w_ptr, n, steps_per_split, num_steps, row_bytes, final_ptr, counters_ptr,
    BLOCK_N: tl.constexpr, ROWS: tl.constexpr, SPLIT: tl.constexpr, ASM: tl.constexpr,
    SERIAL: tl.constexpr, PLANES: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """Q6_K times ROWS rows of x (DP4A=True), the activations quantised first (_q8_kernel: words
    at x_ptr, scales at d_ptr, row r's at r K / 4 and r K / 32): per sub-block of 16, d sc d_x
    (sum(q q_x) - 32 sum(q_x)), the sums by dp4a, into a float32 [BLOCK_N, 2, 2, 2, 2]
    accumulator a row (q6k_step_words' sub-blocks) summed once at the end. Several rows: the
    step's quants and d sc are unpacked once for all of them, and each row's terms go into its
    own slice of a [ROWS, BLOCK_N, 2, 2, 2, 2] accumulator: each row's arithmetic is one row's,
    in the same order. PLANES: the weight in planes (gguf_planes; num_steps blocks a row), its
    quants loaded as words."""
    pdl_wait(PDL)
    s_lo, s_hi, offs_n, mask_n, row = _program_slice(w_ptr, tl.program_id(0), n, steps_per_split, num_steps, row_bytes, BLOCK_N)
    ROWS_P2: tl.constexpr = triton.next_power_of_2(ROWS)
    rows_at = tl.arange(0, ROWS_P2)[:, None, None, None, None, None]
    acc = tl.zeros([BLOCK_N, 2, 2, 2, 2] if ROWS == 1 else [ROWS_P2, BLOCK_N, 2, 2, 2, 2], dtype=tl.float32)
    h = tl.arange(0, 2)[:, None, None, None, None]
    g = tl.arange(0, 2)[None, :, None, None, None]
    v = tl.arange(0, 4)[None, None, :, None, None]
    b = tl.arange(0, 2)[None, None, None, :, None]
    a = tl.arange(0, 2)[None, None, None, None, :]
    words_at = 32 * h + 16 * a + 8 * b + 4 * g + v  # element 128 h + 32 (2 a + b) + 16 g + 4 v
    h, g = tl.arange(0, 2)[:, None, None, None], tl.arange(0, 2)[None, :, None, None]
    b, a = tl.arange(0, 2)[None, None, :, None], tl.arange(0, 2)[None, None, None, :]
    groups_at = 4 * h + 2 * a + b  # the words' groups of 32 (by h, b, a), [2, 1, 2, 2]
    scales_at = 8 * h + 4 * a + 2 * b + g  # and sub-blocks of 16, [2, 2, 2, 2]
    for step in range(s_lo, s_hi):
        base, ql_at, qh_at, sc_at, d_at = q6k_fields(row, step, num_steps, PLANES)
        q = q6k_step_words(base, ql_at, qh_at, PLANES)
        sc = tl.load((base[:, None, None, None, None] + sc_at + scales_at[None]).to(tl.pointer_type(tl.int8)))
        d_sc = f16_at(base + d_at)[:, None, None, None, None] * sc.to(tl.float32)
        for r in tl.static_range(ROWS):
            at = step if r == 0 else r * num_steps + step  # (row 0: no address arithmetic a step)
            x_words = tl.load(x_ptr + at * 64 + words_at)
            x_sums = tl.sum(dp4a(tl.full(x_words.shape, 0x01010101, tl.int32), x_words, tl.zeros_like(x_words), ASM), axis=2)
            dots = tl.sum(dp4a(q, tl.broadcast_to(x_words[None], q.shape), tl.zeros_like(q), ASM), axis=3)
            d_x = tl.load(d_ptr + at * 8 + groups_at)
            terms = d_sc * (d_x[None] * (dots - 32 * x_sums[None]).to(tl.float32))
            if ROWS == 1:
                acc += terms
            else:  # (x + 0.0 is x: the other rows' sums are left as they are)
                acc += tl.where(rows_at == r, terms[None], 0.0)
    # out [ROWS, n] (contiguous), or float32 partials [splits, ROWS, n] when SPLIT
    total = tl.sum(tl.sum(tl.sum(tl.sum(acc, axis=-1), axis=-1), axis=-1), axis=-1)
    if ROWS == 1:
        store_tile(out_ptr, total, offs_n, mask_n, n, final_ptr, counters_ptr, SPLIT, SERIAL)
    else:
        rows_at = tl.arange(0, ROWS_P2)[:, None]
        offs, mask = rows_at * n + offs_n[None, :], (rows_at < ROWS) & mask_n[None, :]
        store_tile(out_ptr, total, offs, mask, ROWS * n, final_ptr, counters_ptr, SPLIT, SERIAL)


def gguf_gemm_rows(
    x: torch.Tensor, blocks: torch.Tensor, qtype: str, block_n: int | None = None,
    programs_per_sm: int | None = None, factored: bool | None = None, unroll: int = 1,
    num_warps: int | None = None, gemv: bool | None = None, lowp: bool | None = None,
    num_stages: int | None = None, dp4a: bool | None = None, prequant: bool | None = None,
) -> torch.Tensor:  # fmt: skip
    """x [M <= MAX_ROWS, K] (float32/float16/bfloat16) @ the qtype weight in blocks [N, K // e, bytes]
    (Q6_K: or its planes, gguf_planes) transposed -> [M, N] in x's dtype. block_n: output channels per program, a power of two
    >= 16 (default BLOCK_N; DP4A_ROWS_BLOCK_N for DP4A with several rows; DP4A_ONE_ROW_TILE's
    for DP4A with one row, with its warps). A grid of too few
    output tiles for about programs_per_sm (default PROGRAMS_PER_SM) programs on every SM
    splits K in whole steps, as the w4a16 kernel does
    (mmserve/kernels/_common.k_splits); 0 never splits. factored: Q4_K / Q5_K's form of the
    product (default FACTORED). gemv: one row by the kernel without tensor cores (default
    GEMV). lowp: the K-quants with 16-bit x dequantised in x's dtype (default LOWP). unroll
    (steps a loop iteration reads) and num_warps (default 4, or DP4A_ONE_ROW_TILE's): for
    scripts/bench_gguf.py's sweep. num_stages: the loop's software pipeline (default
    NUM_STAGES). dp4a: the
    activations in int8 (default uses_dp4a: DP4A, up to DP4A_MAX_ROWS rows of 16-bit x, Q4_K /
    Q5_K; Q6_K in planes with Q6K_ALIGNED): Q4_K / Q5_K up to MAX_ROWS rows, Q6_K up to
    Q6K_DP4A_MAX_ROWS; the rows quantised by a kernel of their own first (prequant; default
    DP4A_PREQUANT for one row, always for several and for Q6_K) or inside the product."""
    layout = check_weight("blocks", blocks, qtype)
    fmt, num_blocks, row_bytes, planes = layout.fmt, layout.num_blocks, layout.row_bytes, layout.planes
    check_float("x", x)
    if x.dim() != 2 or x.shape[1] != num_blocks * fmt.elements:
        raise ValueError(
            f"x must be [M, K] with K = {num_blocks * fmt.elements} (blocks "
            f"{list(blocks.shape)} of {qtype}), got {list(x.shape)}"
        )
    rows, k = x.shape
    if rows > MAX_ROWS:
        raise ValueError(f"x has {rows} rows; this kernel takes at most {MAX_ROWS}")
    if block_n is not None and (block_n < 16 or block_n & (block_n - 1)):
        raise ValueError(f"block_n must be a power of two >= 16, got {block_n}")
    check_last_dim_contiguous("x", x)
    check_same_device(x=x, blocks=blocks)
    n = blocks.shape[0]
    out = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    if rows and n:
        programs = PROGRAMS_PER_SM if programs_per_sm is None else programs_per_sm
        dp4a_rows = Q6K_DP4A_MAX_ROWS if qtype == "Q6_K" else MAX_ROWS  # (what the kernels take)
        int8 = uses_dp4a(x, qtype, planes) if dp4a is None else dp4a and rows <= dp4a_rows and qtype in DP4A_KERNEL_TYPES
        tile = DP4A_ONE_ROW_TILE.get(qtype, (BLOCK_N, 4)) if int8 and rows == 1 else (BLOCK_N, 4)
        block_n = block_n or (DP4A_ROWS_BLOCK_N if int8 and rows > 1 else tile[0])
        num_warps = num_warps or tile[1]
        tiles, steps = triton.cdiv(n, block_n), triton.cdiv(k, STEP)
        splits, per_split = k_splits(tiles, steps, grid_sms(x.device), programs)
        target, counters = split_target(out, splits, tiles)
        ends = {**store_args(out, counters), **pdl_launch(x.device)}
        if int8:
            pre = qtype == "Q6_K" or ((rows > 1 or DP4A_PREQUANT) if prequant is None else prequant)
            words, d_x, sum_x = x, x, x  # (unused)
            if pre:
                words = torch.empty(rows, k // 4, dtype=torch.int32, device=x.device)
                d_x, sum_x = torch.empty(2, rows, k // 32, dtype=torch.float32, device=x.device)
                _q8_kernel[(steps, rows)](words, d_x, sum_x, x, x.stride(0), **pdl_launch(x.device))
            common = {"BLOCK_N": block_n, "SPLIT": splits > 1, "ASM": not triton.knobs.runtime.interpret,
                      "num_warps": num_warps, **_stages(NUM_STAGES if num_stages is None else num_stages), **ends}  # fmt: skip
            if qtype == "Q6_K":
                _gguf_q6k_dp4a_kernel[(tiles, splits)](
                    target, words, d_x, blocks, n, per_split, steps, row_bytes, ROWS=rows, PLANES=planes, **common
                )
            else:
                _gguf_dp4a_kernel[(tiles, splits)](
                    target, words if pre else x, d_x, sum_x, blocks, n, per_split, steps, row_bytes,
                    x.stride(0), QTYPE=fmt.type_id, BYTES=fmt.bytes, ROWS=rows, PREQUANT=pre, **common,
                )  # fmt: skip
        elif rows == 1 and (GEMV if gemv is None else gemv):
            _gguf_gemv_kernel[(tiles, splits)](
                target, x, blocks, n, num_blocks, per_split, steps, row_bytes,
                **fmt.kernel_args(), PARTS=STEP_PARTS[fmt.type_id], BLOCK_N=block_n,
                SPLIT=splits > 1, num_warps=num_warps, **ends, PLANES=planes,
            )  # fmt: skip
        else:
            factor = (FACTORED if factored is None else factored) and qtype in ("Q4_K", "Q5_K")
            low = lowp_args(qtype, x.dtype, LOWP if lowp is None else lowp, LOWP_WORDS)
            _gguf_gemm_rows_kernel[(tiles, splits)](
                target, x, blocks, rows, n, num_blocks, per_split, steps, row_bytes,
                x.stride(0), **ends, **fmt.kernel_args(), PLANES=planes,
                PARTS=STEP_PARTS[fmt.type_id], IEEE=x.dtype == torch.float32,
                BLOCK_M=max(8 if low["LOWP"] else 16, triton.next_power_of_2(rows)), BLOCK_N=block_n,
                SPLIT=splits > 1, FACTORED=factor and not low["LOWP"], UNROLL=unroll, **low,
                num_warps=num_warps,
                **_stages(NUM_STAGES if num_stages is None else num_stages),
            )  # fmt: skip
        finish_splits(out, target, counters)
    return out


def uses_dp4a(x: torch.Tensor, qtype: str, planes: bool = False) -> bool:
    """Whether gguf_gemm_rows multiplies x by a qtype weight with int8 activations by default
    (planes: Q6_K's weight is in planes, which one row of Q6_K takes so, and up to DP4A_MAX_ROWS
    rows with Q6K_ALIGNED on)."""
    rows = x.shape[0] if x.dim() == 2 else 0
    types = (*DP4A_TYPES, "Q6_K") if planes and (rows == 1 or Q6K_ALIGNED) else DP4A_TYPES
    return DP4A and 1 <= rows <= DP4A_MAX_ROWS and qtype in types and x.dtype != torch.float32


def gguf_product_ref(x: torch.Tensor, blocks: torch.Tensor, qtype: str) -> torch.Tensor:
    """float32 [M, N]: the reference of gguf_matmul's arithmetic for x: gguf_matmul_dp4a_ref
    where it uses int8 activations (uses_dp4a), else gguf_matmul_ref."""
    int8 = uses_dp4a(x, qtype, qtype == "Q6_K" and is_planes(blocks))
    return (gguf_matmul_dp4a_ref if int8 else gguf_matmul_ref)(x, blocks, qtype)


def _stages(num_stages: int | None) -> dict[str, int]:
    return {} if num_stages is None else {"num_stages": num_stages}


def gguf_matmul(
    x: torch.Tensor, blocks: torch.Tensor, qtype: str, chunk_elements: int = CHUNK_ELEMENTS
) -> torch.Tensor:
    """x [M, K] @ W^T -> [M, N] in x's dtype, W the qtype weight in blocks: the few-rows kernel
    up to MAX_ROWS rows, else W dequantised to x's dtype (chunk_elements at a time) and
    torch.matmul."""
    if x.dim() == 2 and x.shape[0] <= MAX_ROWS:
        return gguf_gemm_rows(x, blocks, qtype)
    layout = check_weight("blocks", blocks, qtype)
    check_float("x", x)
    k = layout.num_blocks * layout.fmt.elements
    if x.dim() != 2 or x.shape[1] != k:
        raise ValueError(f"x must be [M, K] with K = {k}, got {list(x.shape)}")
    return matmul_in_column_chunks(
        x, blocks.shape[0], chunk_elements,
        lambda cols: gguf_dequantize(blocks[cols], qtype, x.dtype, LOWP, LOWP_WORDS).t(),
    )


def gguf_matmul_ref(x: torch.Tensor, blocks: torch.Tensor, qtype: str) -> torch.Tensor:
    """float32 [M, N]: x @ W^T with W from the gguf package's dequantiser."""
    from mmserve.kernels.gguf_blocks import gguf_dequantize_ref

    return x.float() @ gguf_dequantize_ref(blocks, qtype).t()


def gguf_matmul_dp4a_ref(x: torch.Tensor, blocks: torch.Tensor, qtype: str) -> torch.Tensor:
    """float32 [M, N]: the int8-activation products' arithmetic (CUDA's DP4A for
    DP4A_KERNEL_TYPES; the CPU's cpu_gguf.q8_gemm for every type) on gguf's dequantised weight
    W: the activations rounded by q8_round_trip times W (a min meets the rounded activations'
    sum, ggml's q8_1 s)."""
    from mmserve.kernels.gguf_blocks import gguf_dequantize_ref

    return int8_activations_ref(x, gguf_dequantize_ref(blocks, qtype))
