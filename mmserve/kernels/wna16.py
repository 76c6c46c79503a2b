"""Weight-only int4 / int8 products (w4a16, w8a16): out = x @ W^T with W dequantised inside the
product, W[n, k] = (q[k, n] - z[g, n]) * s[g, n] for k's group g = k // group_size.

One layout serves every weight-only format after repacking at load (models/weight_only.py:
compressed-tensors pack-quantized, GPTQ, AWQ): qweight int32 [K / per, N] with per = 32 / bits
values of consecutive input channels in each word, value j of a word at bits j * bits (GPTQ's
own order); scales and zeros [groups, N] in the compute dtype (zeros as unsigned values, so a
symmetric format has zeros of 2^(bits - 1)). An act-order checkpoint's input channels are
permuted at load so that groups are contiguous; the caller permutes x the same way.

A program owns BLOCK_M rows by BLOCK_N output channels and walks K in steps of 16 words of each
column (128 channels at 4 bits): it loads each packed word once and, for each of a word's per
values in turn, takes that value out of all 16 words at once and multiplies it, dequantised,
with the 16 matching input channels on the tensor cores (fp32 accumulation), so the unpacked
values are never reshaped. Scales (and zeros, which a symmetric weight does not have: its zero
point is 2^(bits - 1)) come one row per step inside a group, one row per word otherwise. For a
decode step (a few rows) the weights stream from memory once, with K split into slices when the
output tiles alone are too few for the SMs. Over MAX_KERNEL_ROWS rows (prefill) the weight is
dequantised by one more kernel, a slice of columns at a time, and multiplied by torch.matmul.
(The first version, one word load per value and 32-channel steps, took 18 ms per 8B decode
step on the H200, 15x its bandwidth floor: latency-bound on its serial K loop. The second
unpacked each step to [128, N] with a reshape. This one, in CUDA graphs at one row: qkv 19.5 us,
o 14.5, gate_up 60.2, down 36.8, about bf16's time for a quarter of its bytes (600-1,000 GB/s).
A kernel without tensor cores for 1-4 rows (float32 dequantisation, one sum over the words at
the end) measured 25.1 / 23.0 / 85.6 / 51.2 us at one row and 3-5x slower at four: removed.
Session 13: values are dequantised by putting q into a float's mantissa (a bitcast, no
int-to-float conversion): the same times at one row (19.5 / 14.7 / 59.7 / ~37 us), so the
conversions were not the limit; a second kernel without tensor cores that folds the zero point
and scale once per word (x * (1 + q / 2^bits) summed, one fused multiply-add per value) took
21.8 / 16.8 / 80.4 / 47.3 us at its best tiling at one row and 2-10x more at 2-4 rows: removed.
Session 14: q multiplied as it is on the tensor cores, a step's scale and zero point applied once
after its dots (qkv at one row 19.6-25.1 us against 19.8-24.0, o 16.6 against 14.7: no gain),
and the same with a word's values unpacked two at a time by PTX (qkv 20.6-24.7, o 15.4:
slower): both removed in session 22. The paired unpacking serves LOWP below.)"""

from __future__ import annotations

from dataclasses import dataclass, replace

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
    prefetch_count,
    prefetch_l2,
    q8_values,
    split_target,
    store_args,
    store_product,
    store_tile,
)

WORDS_PER_STEP = 16  # packed words of each column per K step (the dots' K: 16 at least)
MAX_KERNEL_ROWS = 32  # more rows: the weight dequantised (CHUNK_ELEMENTS at a time) + torch.matmul
CHUNK_ELEMENTS = 1 << 25  # (64 MiB of bf16: a large LM head needs no float copy of itself)
PROGRAMS_PER_SM = 4  # a grid smaller than this many programs per SM splits K
# 4-bit steps inside one group of a decode step of at most LOWP_MAX_ROWS rows dequantised in x's
# 16-bit dtype (session 21), (q - z) * s with one subtract and one multiply per pair
# of values (on CUDA the values come two at a time from _two_values's PTX), the weights the
# product's M side (the accumulator transposed) so that Hopper's warpgroup MMA takes them from
# registers, a decode row padded to 8. (q - z) is exact and s is x's dtype, so the weights are
# the float32 path's to the bit. A prototype's loop in sm_90 SASS (Triton 3.6): 6.7 instructions
# a weight against 9.3 (the float32 path) and 8.8 (the raw products with pairs, since removed).
# On an H100 (session 22, scripts/check_lowp.py, bf16, g128, results equal to the float32
# path's): one row of qkv 18.0 against 19.7 us and of down 32.6 against 36.1; 16 rows 35.3
# against 28.1 and 71.9 against 56.6 (16-row tiles as the M side lose), so up to 8 rows only.
LOWP = True
LOWP_MAX_ROWS = 8
# One row of 16-bit activations times a 4-bit weight by _wna16_dp4a_kernel (as gguf_gemm.DP4A): the
# activations quantised to int8 by 32 inside it (ggml's q8_1), a word's eight values split into
# its even and odd ones by a mask and a shift (four bytes each) and multiplied with the
# activations' int8 words by dp4a; per group of 32, s (d_x sum(q q_x) - z d_x sum(q_x)): the
# rounded activations times the whole weight, the zero point meeting their sum as q8_1's s
# (against x's own sum until session 39; see _common.int8_activations_ref). Adds the
# activations' rounding to int8 (on SmolLM2's weights, bench quality: w4a16-g64's KL from float32
# 0.3681 -> 0.3687 nats, that arithmetic emulated). For group sizes that are multiples of 32 (or per channel) and K a
# multiple of 32. On an H100 (session 24, scripts/check_lowp.py, bf16, g128, one row): gate_up 30.2
# against LOWP's 51.3 us, down 20.3 against 32.7, qkv 12.0 against 18.1; engine, 8B w4a16-g128,
# batch 1: 4.50 -> 3.26 ms/token (bf16 6.27, same machine)
DP4A = True
DP4A_BLOCK_N = 128  # (sm_90 SASS, Triton 3.6: 2.29 instructions a weight; 64 channels: 3.91)
# rows the int8-activation product takes by default (dp4a=True: up to DP4A_ROWS). Several rows go
# to _wna16_dp4a_rows_kernel, their activations quantised first by a kernel of their own and a
# step's words unpacked once for all of them: in the sm_90 SASS of its loop 2.64 instructions a
# weight at 2 rows, 3.73 at 4, 6.35 at 8, against LOWP's 6.7-6.9 (session 24). Decode steps at
# 1k context on an H100 (session 26), rows 1/2/4/8: LOWP 3.25/4.64/4.91/5.49 ms, dp4a up to 8 rows
# 3.24/3.44/4.36/5.88: up to 4
DP4A_MAX_ROWS = 4
DP4A_ROWS = 16
# the one-row DP4A kernel's warps a program, programs an SM (its K split) and software-pipeline
# depth (None: Triton's default), swept with DP4A_BLOCK_N by scripts/sweep_dp4a.py. One warp of
# 32 threads x 4 channels covers the 128 channels: each thread holds all 16 words of a step for
# its channels, so a group's sums stay in the thread (sm_90 SASS of the loop: 1.90 instructions
# a weight, no barriers, against 3.13 and 24 barriers a step with 4 warps). On an H100 (session
# 28, the product alone in CUDA graphs, us, qkv / o / gate_up / down at the 8B shape): 4 warps
# and 4 programs an SM 9.96 / 8.58 / 33.35 / 17.61; 1 warp and 8 programs 9.04 / 8.00 / 25.10 /
# 15.75 (gate_up 2,410 GB/s: 84% of a copy of its bytes); 1 warp and 16 programs 10.4 / 8.0 / 25.5 /
# 15.7; 512 channels and 4 warps 12.5 / 9.5 / 28.3 / 17.7. The several-row kernel keeps 4 warps and
# PROGRAMS_PER_SM (not swept).
DP4A_NUM_WARPS = 1
DP4A_PROGRAMS_PER_SM = 8
DP4A_ROWS_NUM_WARPS = 4
DP4A_NUM_STAGES: int | None = None
# the one-row kernel's first steps of weights (16 words of each of its channels a step) asked of
# L2 before pdl_wait (_common.prefetch_l2); 0: none. Off: on an H100 (session 29) 1, 2 and 4
# steps made each of the 8B shape's four products slower alone (gate_up 24.8 -> 26.8, 28.1,
# 30.7 us), and 2 left the engine's batch-1 latency where it was (2.75 ms/token)
DP4A_PREFETCH_STEPS = 0
# one row on _wna16_dp4a_kernel, its activations quantised inside each program's steps (True), or
# as several rows are: quantised once by _wna16_q8_kernel (a launch more), then the rows kernel at
# ROWS=1 with its own launch knobs (False). Is the in-loop quantisation what keeps the one-row
# product at 45% of the H200's bandwidth (session 28's profile)? Not on an H100 (session 41,
# `scripts/sweep_dp4a.py --config ...`, us, qkv / o / gate_up / down, the q8 launch counted):
# 8.82 / 7.93 / 24.80 / 15.30 fused against 9.34 / 8.25 / 25.48 / 16.72. On the H200 (session 42)
# 7.93 / 7.38 / 22.96 / 13.31 against 8.44 / 7.49 / 21.44 / 14.61, and with the rows kernel at 2
# warps and 8 programs an SM 8.50 / 8.30 / 19.18 / 13.98: only gate_up gains (16%)
DP4A_FUSED_ONE_ROW = True
# one row (fused) whose output has fewer DP4A_BLOCK_N-channel tiles than the card has SMs takes
# tiles of half as many channels, so that more SMs stream whole tiles and K is split less. On an
# H200 (session 42, `scripts/sweep_dp4a.py`, the product alone, us, qkv / o / gate_up / down at
# the 8B shape): 128 channels 7.93 / 7.38 / 22.96 / 13.31, 64 channels 7.34 / 6.45 / 27.23 /
# 12.89: gate_up (224 tiles of 128) keeps 128, the others (32-48 tiles) take 64. On an H100
# (session 43, `scripts/sweep_dp4a.py --config DP4A_NARROW=0|1`) alone 8.25 / 7.17 / - / 14.80
# against 8.84 / 7.88 / 25.12 / 15.49, and in the engine (w4a16-g128 batch 1) 2.584 ms/token twice
# against 2.650. Its loads a step ahead (a software pipeline written out in the loop) were removed:
# on the H200 alone gate_up 11% faster, qkv and o 4% slower; in the H100's engine (session 43)
# 2.629 ms/token against 2.584 with narrow tiles, 2.701 against 2.649 without
DP4A_NARROW = True


@triton.jit
def _group_params(scales_ptr, zeros_ptr, offsets, mask, BITS: tl.constexpr, HAS_ZEROS: tl.constexpr):
    """(scale, zero point) as float32 at offsets: a symmetric weight's zero is 2^(bits - 1)."""
    s = tl.load(scales_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    if HAS_ZEROS:
        z = tl.load(zeros_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    else:
        z = tl.full(s.shape, 1 << (BITS - 1), tl.float32)
    return s, z


@triton.jit
def _value_plus_2_23(words, p: tl.constexpr, BITS: tl.constexpr):
    """Value p of each word as the float32 2^23 + q, exactly: q put into the mantissa of
    2^23 (two integer operations and a bitcast in place of an int-to-float conversion, which
    runs at a quarter of the float rate)."""
    return (((words >> (p * BITS)) & ((1 << BITS) - 1)) | 0x4B000000).to(tl.float32, bitcast=True)


@triton.jit
def _two_values(shifted, PAIRS: tl.constexpr):
    """Values 0 and 4 of each 4-bit word (shifted right to its value p: values p and p + 4)
    as two 16-bit floats (PAIRS 1: bf16, 2: fp16), exactly, in three instructions per word:
    the two nibbles and-or-ed into the mantissas of 128.0 (1024.0) twice, 128.0 (1024.0)
    subtracted from both halves at once, the halves split."""
    if PAIRS == 1:
        low, high = tl.inline_asm_elementwise(
            asm="{ .reg .b32 t, m; mov.b32 m, 1124090624; lop3.b32 t, $2, 983055, m, 234; "
            "sub.rn.bf16x2 t, t, m; mov.b32 {$0, $1}, t; }",
            constraints="=h,=h,r", args=[shifted], dtype=(tl.bfloat16, tl.bfloat16),
            is_pure=True, pack=1,
        )  # fmt: skip
    else:
        low, high = tl.inline_asm_elementwise(
            asm="{ .reg .b32 t, m; mov.b32 m, 1677747200; lop3.b32 t, $2, 983055, m, 234; "
            "sub.rn.f16x2 t, t, m; mov.b32 {$0, $1}, t; }",
            constraints="=h,=h,r", args=[shifted], dtype=(tl.float16, tl.float16),
            is_pure=True, pack=1,
        )  # fmt: skip
    return low, high


@triton.jit
def _lowp_dot(x_rows, ks, mask_m, k_hi, w, acc, EVEN_K: tl.constexpr):
    """acc [BLOCK_N, BLOCK_M] + w [WORDS, BLOCK_N] (x's dtype) transposed @ x at channels ks
    transposed: the weights are the product's M side. EVEN_K: every step is whole (no mask
    along K)."""
    mask = mask_m[:, None] if EVEN_K else mask_m[:, None] & (ks < k_hi)[None, :]
    x = tl.load(x_rows + ks[None, :], mask=mask, other=0.0)
    return tl.dot(tl.trans(w), tl.trans(x), acc)


@triton.jit
def _wna16_kernel(
    out_ptr, x_ptr, qweight_ptr, scales_ptr, zeros_ptr,
    rows, n, k, group_size, k_per_split, stride_x, stride_q, stride_s, final_ptr, counters_ptr,
    BITS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUPS: tl.constexpr, HAS_ZEROS: tl.constexpr, SPLIT: tl.constexpr,
    DOT_PRECISION: tl.constexpr, PAIRS: tl.constexpr, LOWP: tl.constexpr,
    EVEN_K: tl.constexpr, SERIAL: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    pdl_wait(PDL)
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_s = tl.program_id(2)  # this program's slice of K: [k_lo, k_hi), whole steps
    k_lo = pid_s * k_per_split
    k_hi = tl.minimum(k, k_lo + k_per_split)
    PER: tl.constexpr = 32 // BITS
    WORDS: tl.constexpr = BLOCK_K // PER
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_w = tl.arange(0, WORDS)
    mask_m = offs_m < rows
    mask_n = offs_n < n
    x_rows = x_ptr + offs_m[:, None].to(tl.int64) * stride_x
    # LOWP accumulates the product transposed, [BLOCK_N, BLOCK_M] (the weights its M side)
    shape: tl.constexpr = [BLOCK_N, BLOCK_M] if LOWP else [BLOCK_M, BLOCK_N]
    acc = tl.zeros(shape, dtype=tl.float32)
    for start in range(k_lo, k_hi, BLOCK_K):
        word_rows = start // PER + offs_w
        mask_w = mask_n[None, :] if EVEN_K else (word_rows < k_hi // PER)[:, None] & mask_n[None, :]
        words = tl.load(  # each word once: [WORDS, BLOCK_N]
            qweight_ptr + word_rows[:, None].to(tl.int64) * stride_q + offs_n[None, :],
            mask=mask_w, other=0,
        )  # fmt: skip
        if GROUPS == 0:  # the step lies in one group: one row of scales and zeros
            group = (start // group_size).to(tl.int64) * stride_s + offs_n[None, :]
            s, z = _group_params(scales_ptr, zeros_ptr, group, mask_n[None, :], BITS, HAS_ZEROS)
        elif GROUPS == 1:  # each word lies in one group: a row of scales per word
            group = ((start + offs_w * PER) // group_size)[:, None].to(tl.int64) * stride_s + offs_n[None, :]
            s, z = _group_params(scales_ptr, zeros_ptr, group, mask_w, BITS, HAS_ZEROS)
        if LOWP:  # (GROUPS 0, 4 bits) values p and p + 4 of each word in x's dtype, two at a time
            dtype = x_ptr.dtype.element_ty
            s16, z16 = s.to(dtype), z.to(dtype)  # (exact: they were x's dtype)
            for p in tl.static_range(PER // 2):
                if PAIRS:
                    low, high = _two_values(words >> (p * BITS), PAIRS)
                else:
                    low = ((words >> (p * BITS)) & 15).to(dtype)
                    high = ((words >> (p * BITS + 16)) & 15).to(dtype)
                ks = start + offs_w * PER + p
                acc = _lowp_dot(x_rows, ks, mask_m, k_hi, (low - z16) * s16, acc, EVEN_K)
                acc = _lowp_dot(x_rows, ks + PER // 2, mask_m, k_hi, (high - z16) * s16, acc, EVEN_K)
        else:
            # value p of every word at once: channels start + w * PER + p, a K of WORDS for the
            # dot (no reshape of the unpacked values, which would cost a trip through shared
            # memory)
            for p in tl.static_range(PER):
                ks = start + offs_w * PER + p
                x = tl.load(x_rows + ks[None, :], mask=mask_m[:, None] & (ks < k_hi)[None, :], other=0.0)
                if GROUPS == 2:  # a group no word respects: scales per value
                    group = (ks // group_size)[:, None].to(tl.int64) * stride_s + offs_n[None, :]
                    s, z = _group_params(scales_ptr, zeros_ptr, group, mask_w, BITS, HAS_ZEROS)
                w = ((_value_plus_2_23(words, p, BITS) - (z + 8388608.0)) * s).to(x.dtype)  # (q - z) * s
                acc = tl.dot(x, w, acc, input_precision=DOT_PRECISION)
    if LOWP:
        acc = tl.trans(acc)
    store_product(  # (out contiguous; SPLIT: float32 partials [splits, rows, n])
        out_ptr, acc, offs_m[:, None].to(tl.int64) * n + offs_n[None, :], mask_m[:, None] & mask_n[None, :],
        pid_s, tl.num_programs(2), rows * n, final_ptr, counters_ptr + pid_m * tl.num_programs(1) + pid_n,
        SPLIT, SERIAL,
    )  # fmt: skip


@triton.jit
def _step_quants(qweight_ptr, row, k_hi, stride_q, offs_n, mask_n):
    """A DP4A step's 4-bit words at rows `row` [4, 4] (word (g, w)) of BLOCK_N columns, as their
    even and odd values' bytes: [4, 4, BLOCK_N, 2]."""
    words = tl.load(
        qweight_ptr + row[:, :, None].to(tl.int64) * stride_q + offs_n[None, None, :],
        mask=(row < k_hi // 8)[:, :, None] & mask_n[None, None, :], other=0,
    )  # fmt: skip
    return tl.join(words & 0x0F0F0F0F, (words >> 4) & 0x0F0F0F0F)


@triton.jit
def _step_scales(scales_ptr, zeros_ptr, k0, k_hi, group_size, stride_s, offs_n, mask_n, HAS_ZEROS: tl.constexpr):
    """The scales and zero points (float32 [4, BLOCK_N]) of a DP4A step's four groups of 32 (a
    symmetric weight's zero: 8)."""
    groups = (k0 + 32 * tl.arange(0, 4)) // group_size
    at_s = groups[:, None] * stride_s + offs_n[None, :]
    mask_s = (k0 + 32 * tl.arange(0, 4) < k_hi)[:, None] & mask_n[None, :]
    s = tl.load(scales_ptr + at_s, mask=mask_s, other=0.0).to(tl.float32)
    if HAS_ZEROS:
        z = tl.load(zeros_ptr + at_s, mask=mask_s, other=0.0).to(tl.float32)
    else:
        z = tl.full(s.shape, 8.0, tl.float32)
    return s, z


@triton.jit
def _wna16_dp4a_kernel(
    out_ptr, x_ptr, qweight_ptr, scales_ptr, zeros_ptr, n, k, group_size, k_per_split, stride_q,
    stride_s, final_ptr, counters_ptr, BLOCK_N: tl.constexpr, HAS_ZEROS: tl.constexpr, SPLIT: tl.constexpr,
    ASM: tl.constexpr, SERIAL: tl.constexpr, PDL: tl.constexpr, PREFETCH: tl.constexpr,
):  # fmt: skip
    """One row (DP4A), 4 bits: K in steps of 128 (four groups of 32, 16 words of each column).
    Word (g, w) of a step holds elements k0 + 32 g + 8 w + j at bits 4 j: its even values
    (j = 2 b) are the bytes of word & 0x0F0F0F0F, its odd ones (2 b + 1) those of (word >> 4) &
    0x0F0F0F0F, and the activations' int8 words are built to match: [4, 4, 2] (g, w, parity),
    byte b element k0 + 32 g + 8 w + 2 b + parity. (Reading the first step's words before
    pdl_wait, that step taken out of the loop, made the product slower: batch-1 decode on an H100
    3.16 -> 4.61 ms, session 27.) PREFETCH steps of weights are asked of L2 before the wait
    instead, the loop unchanged."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < n
    k_lo = tl.program_id(1) * k_per_split
    k_hi = tl.minimum(k, k_lo + k_per_split)
    poison = 0.0  # (NaN where the interpreter finds a prefetched line past the weight)
    if PREFETCH > 0:  # a line of 32 words a row: rows and channels past the slice clamped to its last
        line_rows = tl.minimum(k_lo // 8 + tl.arange(0, 16 * PREFETCH), (k_hi - 1) // 8)
        line_cols = tl.minimum(tl.program_id(0) * BLOCK_N + 32 * tl.arange(0, BLOCK_N // 32), n - 1)
        lines = line_rows[:, None].to(tl.int64) * stride_q + line_cols[None, :]
        poison = prefetch_l2(qweight_ptr, lines, (k // 8 - 1).to(tl.int64) * stride_q + n, ASM)
    pdl_wait(PDL)
    rows = tl.arange(0, 4)[:, None] * 4 + tl.arange(0, 4)[None, :]  # word (g, w): row 4 g + w of the step
    acc = tl.zeros([4, BLOCK_N], dtype=tl.float32) + poison
    for k0 in range(k_lo, k_hi, 128):
        x_words, amax, sum_x = _step_activations(x_ptr, k0, k_hi)
        q = _step_quants(qweight_ptr, k0 // 8 + rows, k_hi, stride_q, offs_n, mask_n)  # [4, 4, BLOCK_N, 2]
        x_q = tl.broadcast_to(x_words[:, :, None, :], q.shape)
        dots = tl.sum(tl.sum(dp4a(q, x_q, tl.zeros_like(q), ASM), axis=3), axis=1)  # [4, BLOCK_N]
        s, z = _step_scales(scales_ptr, zeros_ptr, k0, k_hi, group_size, stride_s, offs_n, mask_n, HAS_ZEROS)
        acc += s * ((amax / 127.0)[:, None] * dots.to(tl.float32) - z * sum_x[:, None])
    store_tile(out_ptr, tl.sum(acc, axis=0), offs_n, mask_n, n, final_ptr, counters_ptr, SPLIT, SERIAL)


@triton.jit
def _step_activations(x_row, k0, k_hi):
    """A DP4A step's 128 activations of the row at x_row (those past k_hi: 0) quantised by 32
    (q8_values): their int8 words [4, 4, 2] (g, w, parity: byte b element k0 + 32 g + 8 w + 2 b
    + parity, to match _step_quants), each group's max |x| and the sum of its rounded values,
    max |x| / 127 sum q (float32 [4]; ggml's q8_1 s), which the zero point meets."""
    g = tl.arange(0, 4)[:, None, None, None]
    w = tl.arange(0, 4)[None, :, None, None]
    b = tl.arange(0, 4)[None, None, :, None]
    p = tl.arange(0, 2)[None, None, None, :]
    at = k0 + 32 * g + 8 * w + 2 * b + p
    x = tl.load(x_row + at, mask=at < k_hi, other=0.0).to(tl.float32)  # [4, 4, 4, 2]
    amax = tl.max(tl.max(tl.max(tl.abs(x), axis=3), axis=2), axis=1)  # [4]
    q = q8_values(x, amax[:, None, None, None])
    x_words = tl.xor_sum((q & 0xFF) << (8 * b), axis=2)  # disjoint bytes
    return x_words, amax, tl.sum(tl.sum(tl.sum(q, axis=3), axis=2), axis=1).to(tl.float32) * (amax / 127.0)


@triton.jit
def _wna16_q8_kernel(words_ptr, d_ptr, sum_ptr, x_ptr, k, stride_x, PDL: tl.constexpr):
    """Step program_id(0) (128 values of K) of row program_id(1) of the activations quantised
    by 32 (_step_activations) for _wna16_dp4a_rows_kernel: int8 words [rows, steps, 4, 4, 2],
    each group's max |x| / 127 and sum [rows, steps, 4]."""
    pdl_wait(PDL)
    step, r = tl.program_id(0), tl.program_id(1)
    x_words, amax, sum_x = _step_activations(x_ptr + r.to(tl.int64) * stride_x, step * 128, k)
    base = r * tl.num_programs(0) + step
    gw = 8 * tl.arange(0, 4)[:, None, None] + 2 * tl.arange(0, 4)[None, :, None] + tl.arange(0, 2)[None, None, :]
    tl.store(words_ptr + base * 32 + gw, x_words)
    tl.store(d_ptr + base * 4 + tl.arange(0, 4), amax / 127.0)
    tl.store(sum_ptr + base * 4 + tl.arange(0, 4), sum_x)


@triton.jit
def _wna16_dp4a_rows_kernel(
    out_ptr, words_ptr, d_ptr, sum_ptr, qweight_ptr, scales_ptr, zeros_ptr, n, k, group_size,
    k_per_split, stride_q, stride_s, num_steps, final_ptr, counters_ptr, ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr, HAS_ZEROS: tl.constexpr, SPLIT: tl.constexpr, ASM: tl.constexpr,
    SERIAL: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """ROWS rows (DP4A), 4 bits, their activations quantised first (_wna16_q8_kernel): a step's
    words, scales and zeros read and unpacked once for all rows (as _wna16_dp4a_kernel's), each
    row's terms added into its row of a [ROWS, 4, BLOCK_N] accumulator summed over the groups
    at the end."""
    pdl_wait(PDL)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < n
    k_lo = tl.program_id(1) * k_per_split
    k_hi = tl.minimum(k, k_lo + k_per_split)
    rows = tl.arange(0, 4)[:, None] * 4 + tl.arange(0, 4)[None, :]  # word (g, w): row 4 g + w of the step
    gw = 8 * tl.arange(0, 4)[:, None, None] + 2 * tl.arange(0, 4)[None, :, None] + tl.arange(0, 2)[None, None, :]
    ROWS_P2: tl.constexpr = triton.next_power_of_2(ROWS)
    rows_at = tl.arange(0, ROWS_P2)[:, None, None]
    acc = tl.zeros([ROWS_P2, 4, BLOCK_N], dtype=tl.float32)
    for k0 in range(k_lo, k_hi, 128):
        q = _step_quants(qweight_ptr, k0 // 8 + rows, k_hi, stride_q, offs_n, mask_n)  # [4, 4, BLOCK_N, 2]
        s, z = _step_scales(scales_ptr, zeros_ptr, k0, k_hi, group_size, stride_s, offs_n, mask_n, HAS_ZEROS)
        for r in tl.static_range(ROWS):
            base = k0 // 128 if r == 0 else r * num_steps + k0 // 128
            x_words = tl.load(words_ptr + base * 32 + gw)  # [4, 4, 2]
            d_x, sum_x = tl.load(d_ptr + base * 4 + tl.arange(0, 4)), tl.load(sum_ptr + base * 4 + tl.arange(0, 4))
            x_q = tl.broadcast_to(x_words[:, :, None, :], q.shape)
            dots = tl.sum(tl.sum(dp4a(q, x_q, tl.zeros_like(q), ASM), axis=3), axis=1)  # [4, BLOCK_N]
            terms = s * (d_x[:, None] * dots.to(tl.float32) - z * sum_x[:, None])
            acc += tl.where(rows_at == r, terms[None], 0.0)
    rows_at = tl.arange(0, ROWS_P2)[:, None]
    offs, mask = rows_at * n + offs_n[None, :], (rows_at < ROWS) & mask_n[None, :]
    store_tile(out_ptr, tl.sum(acc, axis=1), offs, mask, ROWS * n, final_ptr, counters_ptr, SPLIT, SERIAL)


@triton.jit
def _wna16_dequantize_kernel(
    out_ptr, qweight_ptr, scales_ptr, zeros_ptr, k, n, group_size, stride_q, stride_s, stride_out,
    BITS: tl.constexpr, WORDS: tl.constexpr, BLOCK_N: tl.constexpr, HAS_ZEROS: tl.constexpr,
):  # fmt: skip
    """W [K, N] in out's dtype from WORDS rows of words by BLOCK_N columns per program."""
    PER: tl.constexpr = 32 // BITS
    word_rows = tl.program_id(0) * WORDS + tl.arange(0, WORDS)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (word_rows < k // PER)[:, None] & (offs_n < n)[None, :]
    words = tl.load(qweight_ptr + word_rows[:, None].to(tl.int64) * stride_q + offs_n[None, :], mask=mask, other=0)
    for p in tl.static_range(PER):
        ks = word_rows * PER + p
        group = (ks // group_size)[:, None].to(tl.int64) * stride_s + offs_n[None, :]
        s, z = _group_params(scales_ptr, zeros_ptr, group, mask, BITS, HAS_ZEROS)
        w = (_value_plus_2_23(words, p, BITS) - (z + 8388608.0)) * s
        tl.store(out_ptr + ks[:, None].to(tl.int64) * stride_out + offs_n[None, :],
                 w.to(out_ptr.dtype.element_ty), mask=mask)  # fmt: skip


@dataclass(frozen=True)
class Wna16Tiling:
    block_m: int
    block_n: int
    block_k: int  # channels of K per step: WORDS_PER_STEP words of each column
    groups: int  # 0: a step lies in one group, 1: a word does, 2: neither (scales per value)
    num_warps: int
    num_stages: int
    splits: int  # slices of K, each its own program (then summed)
    k_per_split: int  # channels of K per slice, whole steps
    pairs: int = 0  # (lowp, CUDA) two values a word at once: 1 for bf16 x, 2 for fp16 x
    lowp: bool = False  # (groups 0, 4 bits) dequantised in x's 16-bit dtype, the weights the M side


def choose_tiling(
    rows: int, n: int, k: int, group_size: int, num_sms: int, bits: int = 4,
    block_n: int | None = None, words: int = WORDS_PER_STEP, num_stages: int | None = None,
    programs_per_sm: int | None = None, num_warps: int = 4, pairs: int = 0,
    lowp: bool | None = None,
) -> Wna16Tiling:  # fmt: skip
    """Output tiles of 16 x 64 for a decode step (<= 16 rows: its weights are all the work,
    streamed once), wider for more rows; steps of WORDS_PER_STEP words of each column (128
    channels at 4 bits, 64 at 8). A grid of too few output tiles to keep about PROGRAMS_PER_SM
    programs on every SM splits K (each slice of whole steps, partial sums added in order),
    since one program's serial K steps are latency-bound: at one row, 4096 x 4096 took 35-63 us
    on the H200 for every tiling without a split (BENCHMARKS.md, session 11), about 10x its
    floor. At 4 bits a step inside one group dequantises in x's 16-bit dtype when LOWP says so
    and there are at most LOWP_MAX_ROWS rows (lowp None; 8-row tiles). The keyword arguments other than the defaults
    are for sweeps."""
    per = 32 // bits
    block_k = words * per
    groups = 0 if group_size % block_k == 0 or group_size >= k else 1 if group_size % per == 0 else 2
    lowp = LOWP and groups == 0 and bits == 4 and rows <= LOWP_MAX_ROWS if lowp is None else lowp
    block_m = 8 if lowp and rows <= 8 else 16 if rows <= 16 else 32 if rows <= 32 else 64
    block_n = block_n or (64 if block_m < 64 else 128)
    tiles = triton.cdiv(rows, block_m) * triton.cdiv(n, block_n)
    programs = PROGRAMS_PER_SM if programs_per_sm is None else programs_per_sm
    splits, per_split = k_splits(tiles, triton.cdiv(k, block_k), num_sms, programs)
    stages = num_stages or (3 if block_m <= 32 else 2)
    if pairs and not lowp:
        raise ValueError("pairs unpack lowp products' values: lowp needed")
    if lowp and (groups or bits != 4):
        raise ValueError(f"lowp products need 4 bits and steps inside a group ({groups=}, {bits=})")
    return Wna16Tiling(block_m, block_n, block_k, groups, num_warps, stages, splits, per_split * block_k, pairs, lowp)


def _check(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
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
    shapes = [scales.shape] + ([] if zeros is None else [zeros.shape])
    if group_size < 1 or any(tuple(shape) != (groups, n) for shape in shapes):
        raise ValueError(
            f"scales and zeros must be [{groups}, {n}] (group_size {group_size}), got "
            f"{' and '.join(str(list(shape)) for shape in shapes)}"
        )
    if zeros is not None and zeros.stride() != scales.stride():
        raise ValueError(f"zeros must have scales' strides, got {zeros.stride()} and {scales.stride()}")
    check_float("x", x)
    named = {"x": x, "qweight": qweight, "scales": scales} | ({} if zeros is None else {"zeros": zeros})
    for name, t in named.items():
        check_last_dim_contiguous(name, t)
    check_same_device(**named)


def wna16_gemm(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    bits: int,
    group_size: int,
    tiling: Wna16Tiling | None = None,
    dp4a: bool | None = None,
) -> torch.Tensor:
    """x [M, K] (float32/float16/bfloat16) times the packed weight: [M, N] in x's dtype. zeros
    None: a symmetric weight, every zero point 2^(bits - 1) (none read). Up to MAX_KERNEL_ROWS
    rows (decode steps) the product kernel; more (prefill) the weight dequantised to x's dtype,
    CHUNK_ELEMENTS at a time, and torch.matmul: the kernel re-reads and re-dequantises the weight
    for every 64-row tile (on the H200, 64 rows of the 8B shape's gate_up took 393 us against
    bf16's 61, session 12). tiling (for sweeps) forces the kernel. dp4a: int8 activations
    (_wna16_dp4a_kernel, several rows _wna16_dp4a_rows_kernel; default: uses_dp4a)."""
    _check(x, qweight, scales, zeros, bits, group_size)
    rows, k = x.shape
    n = qweight.shape[1]
    if rows > MAX_KERNEL_ROWS and tiling is None:
        return matmul_in_column_chunks(
            x, n, CHUNK_ELEMENTS,
            lambda c: wna16_dequantize(qweight[:, c], scales[:, c], None if zeros is None else zeros[:, c],
                                       bits, group_size, x.dtype),
        )  # fmt: skip
    out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    if rows == 0 or n == 0:
        return out
    if (uses_dp4a(x, bits, group_size) if dp4a is None else dp4a) and tiling is None:
        return _dp4a_product(out, x, qweight, scales, zeros, group_size)
    t = tiling or choose_tiling(rows, n, k, group_size, grid_sms(x.device), bits)
    if t.lowp and x.dtype == torch.float32:  # (float32 x: the float32 path, 16-row tiles)
        t = replace(t, lowp=False, pairs=0, block_m=max(16, t.block_m))
    if x.is_cuda and t.lowp and not t.pairs:  # (LOWP on CUDA: always the paired PTX)
        t = replace(t, pairs={torch.bfloat16: 1, torch.float16: 2}.get(x.dtype, 0))
    if t.pairs and (not x.is_cuda or x.dtype != (torch.bfloat16, torch.float16)[t.pairs - 1]):
        raise ValueError(f"pairs {t.pairs} needs CUDA and {('bf16', 'fp16')[t.pairs - 1]} x, got {x.dtype}")
    grid = (triton.cdiv(rows, t.block_m), triton.cdiv(n, t.block_n), t.splits)
    target, counters = split_target(out, t.splits, grid[0] * grid[1])
    args = (
        target, x, qweight, scales, scales if zeros is None else zeros,
        rows, n, k, group_size, t.k_per_split, x.stride(0), qweight.stride(0), scales.stride(0),
    )  # fmt: skip
    meta = {
        "BITS": bits, "BLOCK_M": t.block_m, "BLOCK_N": t.block_n, "BLOCK_K": t.block_k,
        "GROUPS": t.groups, "HAS_ZEROS": zeros is not None, "SPLIT": t.splits > 1,
        "PAIRS": t.pairs, "LOWP": t.lowp, "EVEN_K": k % t.block_k == 0, "num_warps": t.num_warps,
        "num_stages": t.num_stages, **store_args(out, counters), **pdl_launch(x.device),
    }  # fmt: skip
    _wna16_kernel[grid](*args, **meta, DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32")
    return finish_splits(out, target, counters)


def uses_dp4a(x: torch.Tensor, bits: int, group_size: int) -> bool:
    """Whether wna16_gemm multiplies x by default with int8 activations (DP4A): up to
    DP4A_MAX_ROWS rows of 16-bit x, 4 bits, K and the group size multiples of 32 (or one group a
    column)."""
    k = x.shape[1]
    whole = group_size % 32 == 0 or group_size >= k
    few = 1 <= x.shape[0] <= DP4A_MAX_ROWS
    return DP4A and few and x.dtype != torch.float32 and bits == 4 and k % 32 == 0 and whole


def _dp4a_product(
    out: torch.Tensor, x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
    zeros: torch.Tensor | None, group_size: int,
) -> torch.Tensor:  # fmt: skip
    (rows, k), n = x.shape, qweight.shape[1]
    if rows > DP4A_ROWS or k % 32 or not (group_size % 32 == 0 or group_size >= k):
        raise ValueError(
            f"dp4a takes up to {DP4A_ROWS} rows, K and the group size multiples of 32: {rows=}, {k=}, {group_size=}"
        )
    fused = rows == 1 and DP4A_FUSED_ONE_ROW
    block_n, sms = DP4A_BLOCK_N, grid_sms(x.device)
    if fused and DP4A_NARROW and triton.cdiv(n, block_n) < sms:
        block_n //= 2
    tiles, steps = triton.cdiv(n, block_n), triton.cdiv(k, 128)
    programs_per_sm = DP4A_PROGRAMS_PER_SM if fused else PROGRAMS_PER_SM
    splits, per_split = k_splits(tiles, steps, sms, programs_per_sm)
    target, counters = split_target(out, splits, tiles)
    operands = (qweight, scales, scales if zeros is None else zeros, n, k, group_size, per_split * 128,
                qweight.stride(0), scales.stride(0))  # fmt: skip
    meta = {"BLOCK_N": block_n, "HAS_ZEROS": zeros is not None, "SPLIT": splits > 1,
            "ASM": not triton.knobs.runtime.interpret, "num_warps": DP4A_NUM_WARPS if fused else DP4A_ROWS_NUM_WARPS,
            **store_args(out, counters), **pdl_launch(x.device)}  # fmt: skip
    if DP4A_NUM_STAGES is not None:
        meta["num_stages"] = DP4A_NUM_STAGES
    if fused:
        prefetch = prefetch_count(min(DP4A_PREFETCH_STEPS, per_split))
        _wna16_dp4a_kernel[(tiles, splits)](target, x, *operands, PREFETCH=prefetch, **meta)
    else:  # the rows' activations quantised first, then the words unpacked once for all of them
        words = torch.empty(rows, steps * 32, dtype=torch.int32, device=x.device)
        d_x, sum_x = torch.empty(2, rows, steps * 4, dtype=torch.float32, device=x.device)
        _wna16_q8_kernel[(steps, rows)](words, d_x, sum_x, x, k, x.stride(0), **pdl_launch(x.device))
        _wna16_dp4a_rows_kernel[(tiles, splits)](target, words, d_x, sum_x, *operands, steps, ROWS=rows, **meta)
    return finish_splits(out, target, counters)


def wna16_dequantize(
    qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, bits: int,
    group_size: int, dtype: torch.dtype,
) -> torch.Tensor:  # fmt: skip
    """The packed weight as W^T [K, N] in dtype, by one kernel (column slices of the operands
    welcome: only their last dimension need be contiguous): dequantize_packed(...).t() computed
    the same way, in float32 and then cast."""
    k, n = qweight.shape[0] * (32 // bits), qweight.shape[1]
    out = torch.empty(k, n, dtype=dtype, device=qweight.device)
    if k and n:
        words, block_n = 16, 64
        grid = (triton.cdiv(k // (32 // bits), words), triton.cdiv(n, block_n))
        _wna16_dequantize_kernel[grid](
            out, qweight, scales, scales if zeros is None else zeros, k, n, group_size,
            qweight.stride(0), scales.stride(0), out.stride(0),
            BITS=bits, WORDS=words, BLOCK_N=block_n, HAS_ZEROS=zeros is not None,
        )  # fmt: skip
    return out


def dequantize_packed(
    qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, bits: int, group_size: int
) -> torch.Tensor:
    """The torch reference of the layout: W [N, K] float32 (zeros None: 2^(bits - 1))."""
    per = 32 // bits
    shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=qweight.device)
    q = (qweight.unsqueeze(1) >> shifts.view(1, per, 1)) & ((1 << bits) - 1)  # [K/per, per, N]
    q = q.reshape(-1, qweight.shape[1]).float()  # [K, N]
    groups = torch.arange(q.shape[0], device=q.device) // group_size
    z = float(1 << (bits - 1)) if zeros is None else zeros.float()[groups]
    return ((q - z) * scales.float()[groups]).t()


def wna16_gemm_ref(
    x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
    bits: int, group_size: int,
) -> torch.Tensor:  # fmt: skip
    """float32 [M, N]: x times the dequantised weight."""
    return x.float() @ dequantize_packed(qweight, scales, zeros, bits, group_size).t()


def wna16_dp4a_ref(
    x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
    bits: int, group_size: int,
) -> torch.Tensor:  # fmt: skip
    """float32 [M, N]: the DP4A product's arithmetic (_common.int8_activations_ref) on the
    dequantised weight, (q - z) s."""
    return int8_activations_ref(x, dequantize_packed(qweight, scales, zeros, bits, group_size))


def wna16_product_ref(
    x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
    bits: int, group_size: int,
) -> torch.Tensor:  # fmt: skip
    """float32 [M, N]: the reference of wna16_gemm's default arithmetic for x: wna16_dp4a_ref where
    it uses int8 activations (uses_dp4a), else wna16_gemm_ref."""
    ref = wna16_dp4a_ref if uses_dp4a(x, bits, group_size) else wna16_gemm_ref
    return ref(x, qweight, scales, zeros, bits, group_size)


def pack_columns(q: torch.Tensor, bits: int) -> torch.Tensor:
    """Unsigned values [K, N] (K a multiple of 32 / bits) -> the layout's int32 [K / per, N]."""
    per = 32 // bits
    k, n = q.shape
    if k % per:
        raise ValueError(f"K = {k} is not a multiple of {per} (values per int32 at {bits} bits)")
    shifts = torch.arange(0, 32, bits, dtype=torch.int64, device=q.device).view(1, per, 1)
    words = (q.to(torch.int64).view(k // per, per, n) << shifts).sum(1)  # (disjoint bits)
    return (words - ((words >> 31) << 32)).to(torch.int32)
