"""Attention over the paged KV cache for mixed batches: prefill chunks and decodes in one launch.

A program takes BLOCK_Q query tokens of one request and all GROUP query heads that share one KV
head, packed as BLOCK_M = BLOCK_Q * GROUP rows, so each K/V tile is loaded once per group (GQA).
It walks the request's KV tiles with an online softmax in fp32 (base 2: log2(e) is folded into
the scale). For batches too small to fill the GPU (decodes, a short turn after a long cached
prompt) the KV range is split over several programs (flash-decoding); a second kernel merges
their partial results by log-sum-exp.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from mmserve.kernels._common import (
    check_at_least,
    check_cache_dtype,
    check_float,
    check_index_dtype,
    check_last_dim_contiguous,
    check_ndim,
    check_same_device,
    check_shape,
    num_sms,
    pdl_launch,
    pdl_wait,
)
from mmserve.kernels.paged_ref import FP8, NO_SCALES, attend, gather_context
from mmserve.kernels.reshape_and_cache import check_scales

MAX_HEAD_DIM = 256
MAX_GROUP = 128  # query heads per KV head; one program holds a whole group
# (block_m, block_n, num_warps, num_stages) by head_dim padded to a power of 2 (at least 64):
# the best of sweeps on an H200 in bf16 over decode, prefill and mixed batches (for head_dim
# 128, 128 rows gain ~6% on prefill-only batches but lose ~20-40% once decodes ride along);
# the 256 rows are unmeasured.
_DECODE_TILES = {64: (16, 128, 4, 3), 128: (16, 64, 4, 2), 256: (16, 64, 4, 2)}
_PREFILL_TILES = {64: (64, 128, 4, 3), 128: (64, 32, 4, 2), 256: (64, 32, 8, 2)}
# An FP8 cache's decode tiles at head_dim 128: twice the keys per tile (the same bytes as bf16's)
# and one more stage. H200, 8B shape, two sweeps: batch 64 x 1k context 87 us against 107 with
# bf16's tiles (bf16's own: 82-84), 16 x 4k 88-156 against 165-190, 1 x 8k 72-129 against
# 114-190 (runs vary; this one was ahead in every case of both). Other head sizes: bf16's.
_FP8_DECODE_TILES = {**_DECODE_TILES, 128: (16, 128, 4, 3)}
_MAX_SPLITS = 32
_PROGRAMS_PER_SM = 4  # a decode program is latency-bound; several per SM hide it
# (The split-KV merge by the last split program of each tile, in place of _merge_splits_kernel's
# launch, was built and timed in sessions 40-42: bf16 batch-1 latency at the 8B shape 5.333
# against 5.301 ms/token on an H100, 4.098 against 4.058 on the H200. No gain: removed.)
# A finite "minus infinity": fully masked rows then never compute inf - inf = NaN.
_NO_SCORE = tl.constexpr(-1.0e30)


@dataclass(frozen=True)
class AttentionTiling:
    block_m: int  # rows of one program: block_q query tokens x group query heads (power of 2)
    block_q: int  # query tokens of one program, block_m // group
    block_n: int  # keys per KV tile
    num_warps: int
    num_stages: int


def choose_tiling(
    head_dim: int, group: int, max_query_len: int, fp8_cache: bool = False
) -> AttentionTiling:
    """A decode step (one token's group fits 16 rows, the least tl.dot takes) streams K/V with
    one 16-row tile; a prefill gets 64-128 rows. A group never straddles two programs."""
    head_dim_p = max(64, triton.next_power_of_2(head_dim))
    rows = max(16, triton.next_power_of_2(max(1, max_query_len) * group))
    decode_tiles = _FP8_DECODE_TILES if fp8_cache else _DECODE_TILES
    tiles = decode_tiles if rows == 16 else _PREFILL_TILES
    block_m, block_n, num_warps, num_stages = tiles[head_dim_p]
    block_m = max(min(block_m, rows), triton.next_power_of_2(group))
    return AttentionTiling(block_m, block_m // group, block_n, num_warps, num_stages)


def choose_num_splits(
    num_programs: int,
    max_seq_len: int,
    block_n: int,
    num_sms: int,
    programs_per_sm: int = _PROGRAMS_PER_SM,
    min_tiles: int = 1,
) -> int:
    """Splits the KV range of a batch too small to fill the GPU until there are about
    programs_per_sm programs per SM, each split at least min_tiles KV tiles long. Short contexts
    split too: at batch 1 (8B shape, 8 programs) a 129-256 token context takes 5.8-5.9 us in
    3-4 splits against 6.3-7.6 us in one (H200, bf16). num_sms=0 (no GPU) means no split."""
    if num_programs <= 0 or num_programs >= num_sms:
        return 1
    by_length = max_seq_len // (block_n * min_tiles) if min_tiles > 1 else triton.cdiv(max_seq_len, block_n)
    by_occupancy = triton.cdiv(programs_per_sm * num_sms, num_programs)
    return max(1, min(_MAX_SPLITS, by_length, by_occupancy))


# Steps with several query tokens (a prompt mostly found in the prefix cache, a short prompt
# beside a few decodes): as few programs as query tiles times KV heads, each walking the whole
# context. A 64-token turn after a 4,096-token cached system prompt on the 8B shape is 40
# programs on 132 SMs, each over 130 KV tiles: split until about _PREFILL_PROGRAMS_PER_SM per
# SM, each split at least _PREFILL_MIN_TILES tiles (a prefill program's tile is 4x a decode
# one's rows, so fewer per SM and longer splits than decode's). Unmeasured choices.
_PREFILL_PROGRAMS_PER_SM = 2
_PREFILL_MIN_TILES = 4


def auto_num_splits(
    num_tokens: int,
    num_reqs: int,
    num_kv_heads: int,
    max_query_len: int,
    max_seq_len: int,
    tiling: AttentionTiling,
    num_sms: int,
) -> int:
    """paged_attention's split count when the caller names none: decode-only batches by
    choose_num_splits' defaults; steps with several query tokens by its prefill arguments,
    counting the programs the launch has (query tiles, one partial tile per request, times KV
    heads)."""
    if max_query_len == 1:
        return choose_num_splits(num_reqs * num_kv_heads, max_seq_len, tiling.block_n, num_sms)
    programs = (num_tokens // tiling.block_q + num_reqs) * num_kv_heads
    return choose_num_splits(
        programs, max_seq_len, tiling.block_n, num_sms, _PREFILL_PROGRAMS_PER_SM, _PREFILL_MIN_TILES
    )


@triton.jit
def _find_request(query_start_loc_ptr, num_reqs, tile, BLOCK_Q: tl.constexpr):
    # Request r owns the global query tiles [first(r), first(r + 1)) with
    # first(r) = query_start_loc[r] // BLOCK_Q + r, strictly increasing: binary-search it.
    lo = 0
    hi = num_reqs
    while lo < hi:
        mid = (lo + hi) // 2
        if tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid <= tile:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


# (num_reqs, stride_bt and num_splits vary step to step: not specialised, else a step of 16,
# 32, ... requests, or whose block table's width is a multiple of 16 or not, compiles a variant
# of its own while serving. The H200 logged such late compiles in a server's first seconds,
# sessions 14 and 15; in 15 the compile's description showed stride_bt not divisible by 16
# where the warm-up's had been)
@triton.jit(do_not_specialize=["num_reqs", "stride_bt"])
def _paged_attention_kernel(
    out_ptr, part_acc_ptr, part_m_ptr, part_l_ptr,  # partials: [T, H, splits, (HEAD_DIM_P)]
    q_ptr, key_cache_ptr, value_cache_ptr, block_tables_ptr, seq_lens_ptr, query_start_loc_ptr,
    scale_log2, v_scale, num_reqs, sliding_window,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_cb, stride_cs, stride_ch, stride_bt,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_P: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, USE_WINDOW: tl.constexpr, SPLIT_KV: tl.constexpr,
    DOT_PRECISION: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    pdl_wait(PDL)
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    num_splits = tl.num_programs(2)
    req = _find_request(query_start_loc_ptr, num_reqs, tile, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + req)
    q_len = tl.load(query_start_loc_ptr + req + 1) - q_start
    q_tile_start = (tile - q_start // BLOCK_Q - req) * BLOCK_Q
    if q_tile_start >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + req)
    context_len = seq_len - q_len  # the query tokens are the last q_len positions

    rows = tl.arange(0, BLOCK_M)
    q_idx = q_tile_start + rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    row_valid = (rows < BLOCK_Q * GROUP) & (q_idx < q_len)
    q_pos = context_len + q_idx
    token = (q_start + q_idx).to(tl.int64)
    dims = tl.arange(0, HEAD_DIM_P)
    dim_valid = dims < HEAD_DIM
    q_offs = token[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :]
    q = tl.load(q_ptr + q_offs, mask=row_valid[:, None] & dim_valid[None, :], other=0.0)

    # Keys any row of this tile may see: [kv_lo, kv_hi); this split takes a slice of its tiles.
    first_q_pos = context_len + q_tile_start
    last_q_pos = context_len + tl.minimum(q_tile_start + BLOCK_Q, q_len) - 1
    kv_lo = 0
    kv_hi = seq_len
    if CAUSAL:
        kv_hi = last_q_pos + 1
    if USE_WINDOW:
        kv_lo = tl.maximum(first_q_pos - sliding_window + 1, 0)
    tile_lo = kv_lo // BLOCK_N
    tiles_per_split = tl.cdiv(tl.cdiv(kv_hi, BLOCK_N) - tile_lo, num_splits)
    start = (tile_lo + split * tiles_per_split) * BLOCK_N
    end = tl.minimum(start + tiles_per_split * BLOCK_N, kv_hi)
    # Keys every row may see: [open_lo, open_hi). Only tiles reaching outside it need a mask.
    open_lo = 0
    open_hi = end
    if CAUSAL:
        open_hi = tl.minimum(first_q_pos + 1, end)
    if USE_WINDOW:
        open_lo = last_q_pos - sliding_window + 1

    m_i = tl.full([BLOCK_M], _NO_SCORE, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_P], tl.float32)
    table_ptr = block_tables_ptr + req.to(tl.int64) * stride_bt
    for kv_start in range(start, end, BLOCK_N):
        k_pos = kv_start + tl.arange(0, BLOCK_N)
        k_valid = k_pos < end
        block = tl.load(table_ptr + k_pos // BLOCK_SIZE, mask=k_valid, other=0).to(tl.int64)
        kv_offs = block * stride_cb + (k_pos % BLOCK_SIZE) * stride_cs + kv_head * stride_ch
        k_t = tl.load(  # [HEAD_DIM_P, BLOCK_N]; an FP8 cache's K's scale is in scale_log2
            key_cache_ptr + kv_offs[None, :] + dims[:, None],
            mask=k_valid[None, :] & dim_valid[:, None],
            other=0.0,
        ).to(q.dtype)
        s = tl.dot(q, k_t, input_precision=DOT_PRECISION) * scale_log2
        if (kv_start < open_lo) | (kv_start + BLOCK_N > open_hi):
            mask = k_valid[None, :]  # rows past the query need none: they are never stored
            if CAUSAL:
                mask &= k_pos[None, :] <= q_pos[:, None]
            if USE_WINDOW:
                mask &= k_pos[None, :] > q_pos[:, None] - sliding_window
            s = tl.where(mask, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(
            value_cache_ptr + kv_offs[:, None] + dims[None, :],
            mask=k_valid[:, None] & dim_valid[None, :],
            other=0.0,
        ).to(q.dtype)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new
    acc = acc * v_scale  # (an FP8 cache's V's scale; 1 otherwise)

    if SPLIT_KV:
        part = (token * (tl.num_programs(1) * GROUP) + head) * num_splits + split
        tl.store(part_m_ptr + part, m_i, mask=row_valid)
        tl.store(part_l_ptr + part, l_i, mask=row_valid)
        acc_offs = part[:, None] * HEAD_DIM_P + dims[None, :]
        tl.store(part_acc_ptr + acc_offs, acc, mask=row_valid[:, None])
    else:
        out = acc / tl.where(row_valid, l_i, 1.0)[:, None]
        out_offs = token[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :]
        tl.store(
            out_ptr + out_offs,
            out.to(out_ptr.dtype.element_ty),
            mask=row_valid[:, None] & dim_valid[None, :],
        )


@triton.jit(do_not_specialize=["num_splits"])
def _merge_splits_kernel(
    out_ptr, part_acc_ptr, part_m_ptr, part_l_ptr, num_splits, stride_ot, stride_oh,
    HEAD_DIM: tl.constexpr, HEAD_DIM_P: tl.constexpr, SPLITS_P: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    pdl_wait(PDL)
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    splits = tl.arange(0, SPLITS_P)
    split_valid = splits < num_splits
    part = (token * tl.num_programs(1) + head) * num_splits + splits
    m = tl.load(part_m_ptr + part, mask=split_valid, other=_NO_SCORE)
    l = tl.load(part_l_ptr + part, mask=split_valid, other=0.0)
    dims = tl.arange(0, HEAD_DIM_P)
    acc = tl.load(
        part_acc_ptr + part[:, None] * HEAD_DIM_P + dims[None, :],
        mask=split_valid[:, None],
        other=0.0,
    )
    weight = tl.exp2(m - tl.max(m, 0))  # an empty split has l = 0 and weighs nothing
    out = tl.sum(acc * weight[:, None], 0) / tl.sum(l * weight, 0)
    tl.store(
        out_ptr + token * stride_ot + head * stride_oh + dims,
        out.to(out_ptr.dtype.element_ty),
        mask=dims < HEAD_DIM,
    )


def paged_attention(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    *,
    max_query_len: int,
    max_seq_len: int,
    scale: float,
    causal: bool = True,
    sliding_window: int | None = None,
    num_splits: int | None = None,
    kv_scales: tuple[float, float] = NO_SCALES,
    busy_reqs: int | None = None,
) -> torch.Tensor:
    """q [T, H, D] over key_cache/value_cache [num_blocks, block_size, Hkv, D]; returns [T, H, D].
    The caches hold q's dtype, or FP8 whose values are stored x / scale (kv_scales: K's, V's).

    query_start_loc [R + 1], seq_lens [R], block_tables [R, max_blocks] (all int32) as in
    AttentionMetadata; request r's queries are the last query_len positions of its seq_len
    context. max_query_len and max_seq_len only steer tile sizes and splitting (the result does
    not depend on them). num_splits: None picks by shape (auto_num_splits: on CUDA, batches
    whose programs do not fill the GPU; busy_reqs: the requests it counts, default all),
    1 turns split-KV off, n > 1 forces n splits. Rows past query_start_loc[-1] are
    left undefined. Not range-checked (that would cost a device sync): seq_lens[r] >= query
    length of r, and block_tables covers each request's seq_len with valid block ids.
    """
    _check_inputs(q, key_cache, value_cache, query_start_loc, seq_lens, block_tables)
    check_at_least("max_query_len", max_query_len, 0)
    check_at_least("max_seq_len", max_seq_len, 0)
    check_at_least("sliding_window", sliding_window, 1)
    check_at_least("num_splits", num_splits, 1)
    if not math.isfinite(scale):
        raise ValueError(f"scale must be finite, got {scale}")
    check_scales(kv_scales)
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = key_cache.shape[2]
    group = num_heads // num_kv_heads
    tiling = choose_tiling(head_dim, group, max_query_len, key_cache.dtype == FP8)
    out = torch.empty_like(q)
    if num_tokens == 0:
        return out
    if num_splits is None:
        sms = num_sms(q.device) if q.is_cuda else 0
        reqs = seq_lens.shape[0] if busy_reqs is None else busy_reqs
        num_splits = auto_num_splits(num_tokens, reqs, num_kv_heads, max_query_len, max_seq_len, tiling, sms)
    head_dim_p = max(16, triton.next_power_of_2(head_dim))
    part_acc = part_m = part_l = out  # placeholders, unused unless split
    if num_splits > 1:
        part_acc = q.new_empty(num_tokens, num_heads, num_splits, head_dim_p, dtype=torch.float32)
        part_m = q.new_empty(num_tokens, num_heads, num_splits, dtype=torch.float32)
        part_l = torch.empty_like(part_m)
    grid = (num_tokens // tiling.block_q + seq_lens.shape[0], num_kv_heads, num_splits)
    _paged_attention_kernel[grid](
        out, part_acc, part_m, part_l,
        q, key_cache, value_cache, block_tables, seq_lens, query_start_loc,
        scale * kv_scales[0] * math.log2(math.e), kv_scales[1], seq_lens.shape[0],
        sliding_window or 0,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2), block_tables.stride(0),
        GROUP=group, HEAD_DIM=head_dim, HEAD_DIM_P=head_dim_p, BLOCK_SIZE=key_cache.shape[1],
        BLOCK_M=tiling.block_m, BLOCK_Q=tiling.block_q, BLOCK_N=tiling.block_n,
        CAUSAL=causal, USE_WINDOW=sliding_window is not None, SPLIT_KV=num_splits > 1,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=tiling.num_warps, num_stages=tiling.num_stages, **pdl_launch(q.device),
    )  # fmt: skip
    if num_splits > 1:
        _merge_splits_kernel[(num_tokens, num_heads)](
            out, part_acc, part_m, part_l, num_splits, out.stride(0), out.stride(1),
            HEAD_DIM=head_dim, HEAD_DIM_P=head_dim_p, SPLITS_P=triton.next_power_of_2(num_splits),
            num_warps=4 if head_dim_p >= 128 else 2, **pdl_launch(q.device),
        )  # fmt: skip
    return out


def _check_inputs(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
) -> None:
    check_ndim("q", q, 3, "[num_tokens, num_heads, head_dim]")
    check_ndim("key_cache", key_cache, 4, "[num_blocks, block_size, num_kv_heads, head_dim]")
    check_shape("value_cache", value_cache, tuple(key_cache.shape))
    num_heads, head_dim = q.shape[1:]
    num_kv_heads = key_cache.shape[2]
    check_shape("key_cache", key_cache, (*key_cache.shape[:3], head_dim))
    if head_dim > MAX_HEAD_DIM:
        raise ValueError(f"head_dim {head_dim} is above the supported {MAX_HEAD_DIM}")
    if num_kv_heads == 0 or num_heads % num_kv_heads:
        raise ValueError(
            f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})"
        )
    if num_heads // num_kv_heads > MAX_GROUP:
        raise ValueError(f"more than {MAX_GROUP} query heads per KV head is not supported")
    check_float("q", q)
    for name, t in (("q", q), ("key_cache", key_cache), ("value_cache", value_cache)):
        check_last_dim_contiguous(name, t)
    check_cache_dtype("key_cache", key_cache)
    if key_cache.dtype not in (q.dtype, torch.float8_e4m3fn) or value_cache.dtype != key_cache.dtype:
        dtypes = f"{q.dtype}, {key_cache.dtype}, {value_cache.dtype}"
        raise ValueError(
            f"key_cache and value_cache must share q's dtype, or both be float8_e4m3fn; got {dtypes}"
        )
    if key_cache.stride() != value_cache.stride():
        raise ValueError("key_cache and value_cache must have the same strides")
    check_ndim("seq_lens", seq_lens, 1, "[num_reqs]")
    check_shape("query_start_loc", query_start_loc, (seq_lens.shape[0] + 1,))
    check_ndim("block_tables", block_tables, 2, "[num_reqs, max_blocks]")
    check_shape("block_tables", block_tables, (seq_lens.shape[0], block_tables.shape[1]))
    check_last_dim_contiguous("block_tables", block_tables)
    indices = {
        "query_start_loc": query_start_loc,
        "seq_lens": seq_lens,
        "block_tables": block_tables,
    }
    for name, t in indices.items():
        check_index_dtype(name, t, torch.int32)
    check_same_device(q=q, key_cache=key_cache, value_cache=value_cache, **indices)


def paged_attention_ref(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    *,
    scale: float,
    causal: bool = True,
    sliding_window: int | None = None,
    kv_scales: tuple[float, float] = NO_SCALES,
) -> torch.Tensor:
    """The torch reference, one request at a time (the CPU backend's gather and attend)."""
    kv_cache = torch.stack((key_cache.view(torch.uint8), value_cache.view(torch.uint8)))
    kv_cache = kv_cache.view(key_cache.dtype)
    starts = query_start_loc.tolist()
    out = torch.empty_like(q)
    for i, seq_len in enumerate(seq_lens.tolist()):
        rows = slice(starts[i], starts[i + 1])
        k, v = gather_context(kv_cache, block_tables[i], seq_len, kv_scales)
        out[rows] = attend(q[rows], k, v, scale, causal, sliding_window)
    return out
