"""GGUF's quantised blocks, read as they lie in the file: the formats, Triton functions that
dequantise a step of them, a kernel that dequantises a whole weight, and the reference.

A quantised weight [N, K] is kept as uint8 [N, K // block_elements, block_bytes]: each row of
the matrix is its row of GGUF blocks, unchanged (ggml's block_q4_0 ... block_q6_K structs,
little-endian). The formats, by ggml's type ids:
- 32-element blocks ("legacy"): Q4_0 (d, 16 bytes of nibbles: (q - 8) d), Q4_1 (d, m: q d + m),
  Q5_0 / Q5_1 (the same with a fifth bit per element in 4 bytes qh), Q8_0 (d, 32 int8).
- 256-element super-blocks (K-quants): Q4_K / Q5_K (d, dmin, 8 sub-blocks of 32 with 6-bit
  scales and mins packed in 12 bytes: q d sc - dmin m), Q6_K (16 sub-blocks of 16 with int8
  scales, 6-bit q - 32, d last).
The kernels read 256 elements of K at a time, each byte of the blocks once, and dequantise in
float32 as ggml computes it (step_part, below). Until session 20 every element gathered its own
bytes (each byte and scale loaded once per element that used it): 231 ms a token for the 8B
shape in Q4_K_M on the H200, 50 times bf16's time.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from mmserve.kernels._common import check_float, check_ndim, check_same_device, q8_values
from mmserve.kernels.gguf_planes import check_planes, is_planes, q6k_blocks, q6k_fields


@dataclass(frozen=True)
class BlockFormat:
    """One GGUF quantisation type's block."""

    type_id: int  # ggml's GGMLQuantizationType value (the kernels' constexpr switch)
    elements: int  # weights per block
    bytes: int  # bytes per block
    # the 32-element blocks' layout: byte offsets of the quants and of the fifth bits (0:
    # none), a min after d, the zero point subtracted from q (-1: q is int8)
    qs: int = 0
    qh: int = 0
    has_min: bool = False
    zero: int = 0

    def kernel_args(self) -> dict[str, int | bool]:
        """The constexprs of dequant_tile."""
        return {"QTYPE": self.type_id, "BYTES": self.bytes, "QS": self.qs, "QH": self.qh,
                "MIN": self.has_min, "ZERO": self.zero}  # fmt: skip


FORMATS = {
    "Q4_0": BlockFormat(2, 32, 18, qs=2, zero=8),
    "Q4_1": BlockFormat(3, 32, 20, qs=4, has_min=True),
    "Q5_0": BlockFormat(6, 32, 22, qs=6, qh=2, zero=16),
    "Q5_1": BlockFormat(7, 32, 24, qs=8, qh=4, has_min=True),
    "Q8_0": BlockFormat(8, 32, 34, qs=2, zero=-1),
    "Q4_K": BlockFormat(12, 256, 144),
    "Q5_K": BlockFormat(13, 256, 176),
    "Q6_K": BlockFormat(14, 256, 210),
}
SUPPORTED = tuple(FORMATS)


def check_blocks(name: str, blocks: torch.Tensor, qtype: str) -> BlockFormat:
    """blocks is uint8 [N, K // elements, bytes] of qtype, contiguous; returns its format."""
    if qtype not in FORMATS:
        raise ValueError(f"qtype {qtype!r} is not one of {list(SUPPORTED)}")
    fmt = FORMATS[qtype]
    check_ndim(name, blocks, 3, "[N, blocks per row, bytes per block]")
    if blocks.dtype != torch.uint8 or blocks.shape[2] != fmt.bytes:
        raise ValueError(
            f"{name} must be uint8 with {fmt.bytes} bytes per {qtype} block, "
            f"got {blocks.dtype} {list(blocks.shape)}"
        )
    if not blocks.is_contiguous():
        raise ValueError(f"{name} must be contiguous, got strides {blocks.stride()}")
    return fmt


# Every type is read a step of 256 elements at a time: a K-quant's super-block, or 8 of the
# 32-element blocks. The bytes of BLOCK_N rows' step are loaded as tiles of whole quants,
# nibbles and scales, along each block's bytes (16 rows of a Q4_K super-block are 16 runs of 128
# quant bytes), each byte once. A step is read in parts of elements that share their bytes'
# positions: Q4_K / Q5_K in 2 (the low nibbles of its 128 quant bytes, then the high ones),
# Q6_K in 4 (its quarters), the 4- and 5-bit 32-element types in 2 (each block's low nibbles,
# elements 0-15, then its high ones), Q8_0 in 1. Each part comes with the element index of each
# of its columns within the step, so a product reads the matching activations and a
# dequantiser writes the matching columns.
STEP = 256  # elements of K per step (the kernels write it as a literal)
STEP_PARTS = {2: 2, 3: 2, 6: 2, 7: 2, 8: 1, 12: 2, 13: 2, 14: 4}  # type id -> parts per step


@triton.jit
def f16_at(ptr):
    """float16 at byte pointers ptr (2-byte aligned: every GGUF scale is), as float32."""
    return tl.load(ptr.to(tl.pointer_type(tl.float16))).to(tl.float32)


@triton.jit
def kquant_part(block, PART: tl.constexpr, QTYPE: tl.constexpr, BLOCK_N: tl.constexpr):
    """(w, cols): part PART of the Q4_K / Q5_K super-blocks at byte pointers block [BLOCK_N],
    float32 [BLOCK_N, P] as ggml dequantises it, and cols [P], each column's element in the
    super-block (Q6_K: q6k_part). Part 0 is the low nibbles of qs[32 c + j], elements 64 c + j (c < 4, j < 32),
    and part 1 the high ones, elements 64 c + 32 + j; P = 128."""
    # Q4_K / Q5_K: d, dmin, scales[12], (Q5_K: qh[32]), qs[128]
    c = tl.arange(0, 4)
    j = tl.arange(0, 32)
    QS: tl.constexpr = 48 if QTYPE == 13 else 16
    qs = tl.load(block[:, None, None] + QS + 32 * c[None, :, None] + j[None, None, :])
    q = (qs.to(tl.int32) >> (4 * PART)) & 15  # [BLOCK_N, 4, 32]
    sub = 2 * c + PART  # each chunk's sub-block of 32
    if QTYPE == 13:  # bit sub of qh[j] is the fifth
        qh = tl.load(block[:, None] + 16 + j[None, :]).to(tl.int32)
        q = q | (((qh[:, None, :] >> sub[None, :, None]) & 1) << 4)
    d1, m1 = _q45k_factors(block, sub)
    w = d1[:, :, None] * q.to(tl.float32) - m1[:, :, None]
    t = tl.arange(0, 128)
    return tl.reshape(w, [BLOCK_N, 128]), 64 * (t // 32) + 32 * PART + t % 32


@triton.jit
def q6k_part(base, ql_at, qh_at, sc_at, d_at, PART: tl.constexpr, BLOCK_N: tl.constexpr):
    """kquant_part of Q6_K (its quarter PART: elements 128 h + 32 PART + l, h < 2, l < 32, P =
    64) from its blocks' ql[128], qh[64], scales[16] (int8) and d at those byte offsets from base
    (gguf_planes.q6k_fields)."""
    h = tl.arange(0, 2)[None, :, None]
    lane = tl.arange(0, 32)[None, None, :]
    ql = tl.load(base[:, None, None] + ql_at + 64 * h + 32 * (PART % 2) + lane).to(tl.int32)
    qh = tl.load(base[:, None, None] + qh_at + 32 * h + lane).to(tl.int32)
    q = ((ql >> (4 * (PART // 2))) & 15) | (((qh >> (2 * PART)) & 3) << 4)
    q = q - 32  # [BLOCK_N, 2, 32]
    g = tl.arange(0, 2)[None, None, :]  # the 16-element sub-block within 32 lanes
    sc = tl.load((base[:, None, None] + sc_at + 8 * h + g + 2 * PART).to(tl.pointer_type(tl.int8))).to(tl.float32)
    d1 = f16_at(base + d_at)[:, None, None] * sc  # [BLOCK_N, 2, 2]
    w = d1[:, :, :, None] * tl.reshape(q.to(tl.float32), [BLOCK_N, 2, 2, 16])
    t = tl.arange(0, 64)
    return tl.reshape(w, [BLOCK_N, 64]), 128 * (t // 32) + 32 * PART + t % 32


@triton.jit
def _q45k_factors(block, sub):
    """d1 = d * scale and m1 = dmin * min (float32 [BLOCK_N, S]) of sub-blocks sub [S] of the
    Q4_K / Q5_K super-blocks at byte pointers block [BLOCK_N]: their 6-bit scales and mins
    unpacked as ggml's get_scale_min_k4 does."""
    scales = block[:, None] + 4
    s_a = tl.load(scales + sub[None, :]).to(tl.int32)
    s_b = tl.load(scales + 4 + sub[None, :]).to(tl.int32)
    s_c = tl.load(scales + tl.maximum(sub - 4, 0)[None, :]).to(tl.int32)
    low_sub = (sub < 4)[None, :]
    sc = tl.where(low_sub, s_a & 63, (s_b & 15) | ((s_c >> 6) << 4))
    mn = tl.where(low_sub, s_b & 63, (s_b >> 4) | ((s_a >> 6) << 4))
    return f16_at(block)[:, None] * sc.to(tl.float32), f16_at(block + 2)[:, None] * mn.to(tl.float32)


# The K-quants dequantised in the product's own 16-bit dtype (LOWP; gguf_gemm.LOWP): a weight
# is d1 q - m1 (Q4_K, Q5_K) or d1 (q - 32) (Q6_K) with d1 and m1 rounded to that dtype first and one
# fused multiply-add per weight pair, where the float32 path (step_part) spends an int-to-float
# conversion, a float32 multiply-add and a conversion down per weight. On an NVIDIA GPU in
# bfloat16 (ASM) the quants become floats by bits: four bytes at a time, each pair of quants
# put into the mantissas of two bfloat16 128.0s (a byte permute and a logical op), then 128
# (Q6_K: 160) subtracted from both at once: exact, since q < 128. The interpreter (CI) runs
# the same arithmetic with a plain conversion (it cannot run assembly). Counted in the sm_90
# SASS of the loop (scripts/sass_loop.py): Q4_K's product went from 11.3 (FACTORED) or 7.4
# instructions per weight and thread to 5.0, Q5_K's from 13.6 or 12.0 to 7.8, Q6_K's from 12.0
# to 7.1 (Triton 3.9; the GPU image's 3.6 gives 4.0, 5.4 and 6.4).
def _bits_asm(low_shift: int, high_shift: int | None = None, high_bits: int = 2) -> tl.constexpr:
    """Inline PTX: four quants' bytes $2 (and the bytes $3 of their high bits) -> four bfloat16
    in two registers: the nibbles at bit low_shift, or-ed with the high_bits bits at bit
    high_shift of $3 as bits 4 and up (Q6_K: two, Q5_K: one), put into the mantissas of
    128.0; then 128 subtracted (Q6_K: 160, taking its q - 32). Q5_K's $3 is first shifted
    right by $4 (its chunk's 2 c, the same for the four quants)."""
    offset = 32 if high_shift is not None and high_bits == 2 else 0
    code = ["{ .reg .b32 a, b, h, u, v, m, k; mov.b32 m, 0x43004300;",
            f"mov.b32 k, {0x4300 + offset:#x}{0x4300 + offset:04x};",
            "mov.b32 a, $2;" if low_shift == 0 else f"shr.b32 a, $2, {low_shift};",
            "shr.b32 h, $3, $4;" if high_bits == 1 else "mov.b32 h, $3;"]  # fmt: skip
    if high_shift is not None:  # the high bits moved to bit 4 of each byte
        move = 4 - high_shift
        code.append(f"shl.b32 b, h, {move};" if move > 0 else f"shr.b32 b, h, {-move};" if move else "mov.b32 b, h;")
    mask = f"{(((1 << high_bits) - 1) << 4) * 0x10001:#010x}"
    for out, pick in ((0, "0x4140"), (1, "0x4342")):  # bytes 0-1, then 2-3, as 16-bit lanes
        code.append(f"prmt.b32 u, a, 0, {pick}; lop3.b32 u, u, 0x000F000F, m, 0xEA;")
        if high_shift is not None:
            code.append(f"prmt.b32 v, b, 0, {pick}; lop3.b32 u, v, {mask}, u, 0xEA;")
        code.append(f"sub.rn.bf16x2 ${out}, u, k;")
    return tl.constexpr(" ".join(code) + " }")


_Q4K_LOW = _bits_asm(0)
_Q4K_HIGH = _bits_asm(4)
_Q5K_LOW = _bits_asm(0, 0, high_bits=1)  # qh's bytes shifted right by the chunk's 2 c ($4) first
_Q5K_HIGH = _bits_asm(4, 1, high_bits=1)
_Q6K_0 = _bits_asm(0, 0)
_Q6K_1 = _bits_asm(0, 2)
_Q6K_2 = _bits_asm(4, 4)
_Q6K_3 = _bits_asm(4, 6)


@triton.jit
def _bits(asm: tl.constexpr, ql, qh):
    return tl.inline_asm_elementwise(asm, "=r,=r,r,r", [ql, qh], dtype=tl.bfloat16, is_pure=True, pack=4)


@triton.jit
def _bits_shifted(asm: tl.constexpr, ql, qh, shift):
    """_bits with an int32 shift of qh's bytes ($4: four registers, one a quant, all equal)."""
    return tl.inline_asm_elementwise(asm, "=r,=r,r,r,r,r,r,r", [ql, qh, shift], dtype=tl.bfloat16,
                                     is_pure=True, pack=4)  # fmt: skip


@triton.jit
def _nibbles_as(qs, HIGH: tl.constexpr, DTYPE: tl.constexpr, ASM: tl.constexpr):
    """uint8 qs -> its low (or HIGH) nibbles in DTYPE, exactly."""
    if ASM:
        if HIGH:
            return _bits(_Q4K_HIGH, qs, qs)
        else:
            return _bits(_Q4K_LOW, qs, qs)
    else:
        return ((qs.to(tl.int32) >> (4 * HIGH)) & 15).to(DTYPE)


@triton.jit
def _q5k_as(qs, qh, shift, HIGH: tl.constexpr, DTYPE: tl.constexpr, ASM: tl.constexpr):
    """Q5_K's quants in DTYPE, exactly: the low (or HIGH) nibbles of qs with bit shift + HIGH of
    qh (shift: int32, the chunk's 2 c) as the fifth."""
    if ASM:
        if HIGH:
            return _bits_shifted(_Q5K_HIGH, qs, qh, shift)
        else:
            return _bits_shifted(_Q5K_LOW, qs, qh, shift)
    else:
        fifth = ((qh.to(tl.int32) >> (shift + HIGH)) & 1) << 4
        return (((qs.to(tl.int32) >> (4 * HIGH)) & 15) | fifth).to(DTYPE)


@triton.jit
def _q6k_quarter_as(ql, qh, QUARTER: tl.constexpr, DTYPE: tl.constexpr, ASM: tl.constexpr):
    """Q6_K's q - 32 in DTYPE, exactly, of quarter QUARTER from its ql and qh bytes."""
    if ASM:
        if QUARTER == 0:
            return _bits(_Q6K_0, ql, qh)
        elif QUARTER == 1:
            return _bits(_Q6K_1, ql, qh)
        elif QUARTER == 2:
            return _bits(_Q6K_2, ql, qh)
        else:
            return _bits(_Q6K_3, ql, qh)
    else:
        low = (ql.to(tl.int32) >> (4 * (QUARTER // 2))) & 15
        return ((low | (((qh.to(tl.int32) >> (2 * QUARTER)) & 3) << 4)) - 32).to(DTYPE)


@triton.jit
def _f16_bits(bits):
    """The float16 in the low 16 bits of int32 bits, as float32."""
    return bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def q45k_words_factors(block):
    """_q45k_factors of every sub-block of the Q4_K / Q5_K super-blocks at byte pointers block
    [BLOCK_N], from their first 16 bytes read as four 32-bit words (one 16-byte load a row;
    their rows of blocks are 16-byte aligned: 144 and 176 bytes a block) and unpacked four
    sub-blocks at a time, as ggml's CUDA kernels do: (d1, m1) of sub-blocks 0, 2, 4, 6, then of 1, 3, 5, 7, each
    float32 [BLOCK_N, 4]. In the sm_90 SASS (scripts/sass_loop.py, 64 channels a program) the
    loads join the loop's pipeline (cp.async), and Q4_K's loop takes 5.0 instructions a weight
    against 6.5 with the scales read byte by byte (Q5_K: 7.8 against 8.1)."""
    words = block.to(tl.pointer_type(tl.int32))
    head, w1, w2, w3 = tl.load(words), tl.load(words + 1), tl.load(words + 2), tl.load(words + 3)
    d, dmin = _f16_bits(head & 0xFFFF), _f16_bits(head >> 16)
    # byte s of sc_lo / mn_lo is sub-block s's scale / min (s < 4), of sc_hi / mn_hi sub-block 4 + s's
    sc_lo, mn_lo = w1 & 0x3F3F3F3F, w2 & 0x3F3F3F3F
    sc_hi = (w3 & 0x0F0F0F0F) | ((w1 >> 2) & 0x30303030)
    mn_hi = ((w3 >> 4) & 0x0F0F0F0F) | ((w2 >> 2) & 0x30303030)
    c = tl.arange(0, 4)[None, :]  # sub-blocks 2 c and 2 c + 1: byte 2 (c % 2) (+ 1) of lo (c < 2) or hi
    sc = tl.where(c < 2, sc_lo[:, None], sc_hi[:, None])
    mn = tl.where(c < 2, mn_lo[:, None], mn_hi[:, None])
    shift = 16 * (c % 2)
    d1_even = d[:, None] * ((sc >> shift) & 0xFF).to(tl.float32)
    m1_even = dmin[:, None] * ((mn >> shift) & 0xFF).to(tl.float32)
    d1_odd = d[:, None] * ((sc >> (shift + 8)) & 0xFF).to(tl.float32)
    m1_odd = dmin[:, None] * ((mn >> (shift + 8)) & 0xFF).to(tl.float32)
    return d1_even, m1_even, d1_odd, m1_odd


@triton.jit
def q45k_step_lowp(block, QTYPE: tl.constexpr, DTYPE: tl.constexpr, ASM: tl.constexpr, WORDS: tl.constexpr,
                   BLOCK_N: tl.constexpr):  # fmt: skip
    """A Q4_K / Q5_K step at byte pointers block [BLOCK_N] in DTYPE (LOWP, above): w_lo
    [BLOCK_N, 128] (the low nibbles of qs[32 c + j], elements 64 c + j), its columns' elements
    [128], then w_hi (the high ones, elements 64 c + 32 + j) and its columns. The bytes are
    loaded once; the scales byte by byte, or (WORDS) as 32-bit words (q45k_words_factors).
    Q5_K's fifth bits (qh[j], bit 2 c for the low nibble of chunk c, 2 c + 1 for the high)."""
    c = tl.arange(0, 4)
    j = tl.arange(0, 32)
    QS: tl.constexpr = 48 if QTYPE == 13 else 16
    qs = tl.load(block[:, None, None] + QS + 32 * c[None, :, None] + j[None, None, :])
    if WORDS:  # Q4_K's and Q5_K's scales lie alike, 16-byte aligned
        d1_lo, m1_lo, d1_hi, m1_hi = q45k_words_factors(block)
    else:
        d1_lo, m1_lo = _q45k_factors(block, 2 * c)
        d1_hi, m1_hi = _q45k_factors(block, 2 * c + 1)
    if QTYPE == 13:
        qh = tl.broadcast_to(tl.load(block[:, None, None] + 16 + j[None, None, :]), qs.shape)
        shift = tl.broadcast_to((2 * c)[None, :, None], qs.shape)
        q_lo = _q5k_as(qs, qh, shift, False, DTYPE, ASM)
        q_hi = _q5k_as(qs, qh, shift, True, DTYPE, ASM)
    else:
        q_lo = _nibbles_as(qs, False, DTYPE, ASM)
        q_hi = _nibbles_as(qs, True, DTYPE, ASM)
    w_lo = q_lo * d1_lo.to(DTYPE)[:, :, None] - m1_lo.to(DTYPE)[:, :, None]
    w_hi = q_hi * d1_hi.to(DTYPE)[:, :, None] - m1_hi.to(DTYPE)[:, :, None]
    t = tl.arange(0, 128)
    cols = 64 * (t // 32) + t % 32
    return tl.reshape(w_lo, [BLOCK_N, 128]), cols, tl.reshape(w_hi, [BLOCK_N, 128]), cols + 32


# One-row products with the activations in int8 (gguf_gemm.DP4A), as ggml's CUDA kernels run a
# K-quant against a q8_1 row (vec_dot_q4_K_q8_1): a Q4_K / Q5_K step's quants stay 32-bit words
# of four bytes (a mask and a shift a word make nibbles of eight weights) and meet the
# activations' int8 words in dp4a (mmserve.kernels._common).


@triton.jit
def q45k_step_words(block, QTYPE: tl.constexpr):
    """A Q4_K / Q5_K step's quants at byte pointers block [BLOCK_N] as int32 words of four
    unsigned bytes, [BLOCK_N, 4, 8, 2]: byte k of word (c, w, h) is the quant of element
    64 c + 32 h + 4 w + k (sub-block 2 c + h). qs[32 c + j] holds elements 64 c + j (its low
    nibble) and 64 c + 32 + j (its high one); Q5_K's fifth bit of element 64 c + 32 h + j is
    bit 2 c + h of qh[j]."""
    c = tl.arange(0, 4)[None, :, None]
    w = tl.arange(0, 8)[None, None, :]
    words = block.to(tl.pointer_type(tl.int32))[:, None, None]
    QS: tl.constexpr = 12 if QTYPE == 13 else 4  # words: Q5_K's qh lies between scales and qs
    qs = tl.load(words + QS + 8 * c + w)
    low, high = qs & 0x0F0F0F0F, (qs >> 4) & 0x0F0F0F0F
    if QTYPE == 13:
        qh = tl.load(words + 4 + w)  # [BLOCK_N, 1, 8]
        low |= ((qh >> (2 * c)) & 0x01010101) << 4
        high |= ((qh >> (2 * c + 1)) & 0x01010101) << 4
    return tl.join(low, high)


@triton.jit
def _words_of_halves(pairs):
    """int32 words from int16 [..., 2] (the low half first)."""
    low, high = tl.split(pairs)
    return (low.to(tl.int32) & 0xFFFF) | (high.to(tl.int32) << 16)


@triton.jit
def q6k_step_words(base, ql_at, qh_at, PLANES: tl.constexpr):
    """A Q6_K step's quants from its ql and qh at those byte offsets from base (q6k_fields) as int32
    words of four unsigned bytes q (0-63; the weight is d sc (q - 32)), [BLOCK_N, 2, 2, 4, 2, 2]:
    byte k of word (h, g, v, b, a) is the quant of element 128 h + 32 p + 16 g + 4 v + k, p = 2 a
    + b (quarter p of half h, sub-block 8 h + 2 p + g), as ggml's dequantize_row_q6_K: the nibble
    p // 2 of ql[64 h + 32 (p % 2) + l] with bits 2 p and 2 p + 1 of qh[32 h + l] above it (l = 16
    g + 4 v + k). In the file's 210-byte blocks rows are only 2-byte aligned, so the words are put
    together from 16-bit loads; in planes (PLANES) they are loaded as words, 16 bytes at a time."""
    h = tl.arange(0, 2)[None, :, None, None]
    g = tl.arange(0, 2)[None, None, :, None]
    v = tl.arange(0, 4)[None, None, None, :]
    if PLANES:
        ql = (base + ql_at).to(tl.pointer_type(tl.int32))[:, None, None, None] + 16 * h + 4 * g + v
        ql_even, ql_odd = tl.load(ql), tl.load(ql + 8)
        qh = tl.load((base + qh_at).to(tl.pointer_type(tl.int32))[:, None, None, None] + 8 * h + 4 * g + v)
    else:  # each word from two 16-bit halves (the last axis, j)
        at = 32 * h + 8 * g + 2 * v  # ql[64 h + l] in 16-bit units
        halves = tl.arange(0, 2)[None, None, None, None, :] + at[:, :, :, :, None]
        ql = (base + ql_at).to(tl.pointer_type(tl.int16))[:, None, None, None, None] + halves
        ql_even, ql_odd = _words_of_halves(tl.load(ql)), _words_of_halves(tl.load(ql + 16))
        qh = (base + qh_at).to(tl.pointer_type(tl.int16))[:, None, None, None, None] + halves - 16 * h[:, :, :, :, None]
        qh = _words_of_halves(tl.load(qh))  # (qh[32 h + l])
    q0 = (ql_even & 0x0F0F0F0F) | ((qh & 0x03030303) << 4)
    q1 = (ql_odd & 0x0F0F0F0F) | (((qh >> 2) & 0x03030303) << 4)
    q2 = ((ql_even >> 4) & 0x0F0F0F0F) | (((qh >> 4) & 0x03030303) << 4)
    q3 = ((ql_odd >> 4) & 0x0F0F0F0F) | (((qh >> 6) & 0x03030303) << 4)
    return tl.join(tl.join(q0, q1), tl.join(q2, q3))


@triton.jit
def q8_step(x_ptr, step):
    """A step's 256 activations (one row at x_ptr) quantised by 32 as ggml's q8_1 does: int32
    words [4, 8, 2] of four int8 (byte k of word (c, w, h): element 64 c + 32 h + 4 w + k, as
    q45k_step_words), each group's scale d = max |x| / 127 and the sum of its rounded values,
    d sum q (float32 [4, 2]; q8_1's s, which a K-quant's min meets); the quants are x 127 /
    max |x| rounded half away from zero."""
    c = tl.arange(0, 4)[:, None, None, None]
    w = tl.arange(0, 8)[None, :, None, None]
    k = tl.arange(0, 4)[None, None, :, None]
    h = tl.arange(0, 2)[None, None, None, :]
    x = tl.load(x_ptr + step * 256 + 64 * c + 32 * h + 4 * w + k).to(tl.float32)
    amax = tl.max(tl.max(tl.abs(x), axis=2), axis=1)  # [4, 2]
    q = q8_values(x, amax[:, None, None, :])
    words = tl.xor_sum((q & 0xFF) << (8 * k), axis=2)  # disjoint bytes: xor is or
    d = amax / 127.0
    return words, d, tl.sum(tl.sum(q, axis=2), axis=1).to(tl.float32) * d


@triton.jit
def q6k_bytes(base, ql_at, qh_at):
    """The Q6_K super-blocks' quant bytes, their ql and qh at those byte offsets from base
    (q6k_fields), each loaded once: ql[64 h + l] (quarters 0 and 2 read them), ql[64 h + 32 + l]
    (quarters 1 and 3) and qh[32 h + l] (all four), uint8 [BLOCK_N, 2, 32] (h < 2, l < 32)."""
    h, lane = tl.arange(0, 2)[None, :, None], tl.arange(0, 32)[None, None, :]
    at = base[:, None, None] + ql_at + 64 * h + lane  # (qh's addresses from ql's: fewer instructions)
    return tl.load(at), tl.load(at + 32), tl.load(at + (qh_at - ql_at) - 32 * h)


@triton.jit
def q6k_quarter_lowp(base, sc_at, d_at, ql_even, ql_odd, qh, QUARTER: tl.constexpr, DTYPE: tl.constexpr,
                     ASM: tl.constexpr, BLOCK_N: tl.constexpr):  # fmt: skip
    """Quarter QUARTER of the Q6_K super-blocks in DTYPE (LOWP, above), from their bytes
    (q6k_bytes) and their scales and d at those byte offsets from base (q6k_fields): [BLOCK_N, 64],
    elements 128 h + 32 QUARTER + l, and those elements [64]."""
    if QUARTER % 2 == 0:
        q = _q6k_quarter_as(ql_even, qh, QUARTER, DTYPE, ASM)  # [BLOCK_N, 2, 32]
    else:
        q = _q6k_quarter_as(ql_odd, qh, QUARTER, DTYPE, ASM)
    h = tl.arange(0, 2)[None, :, None]
    g = tl.arange(0, 2)[None, None, :]  # the 16-element sub-block within 32 lanes
    sc = tl.load((base[:, None, None] + sc_at + 8 * h + g + 2 * QUARTER).to(tl.pointer_type(tl.int8)))
    d1 = (f16_at(base + d_at)[:, None, None] * sc.to(tl.float32)).to(DTYPE)  # [BLOCK_N, 2, 2]
    w = d1[:, :, :, None] * tl.reshape(q, [BLOCK_N, 2, 2, 16])
    t = tl.arange(0, 64)
    return tl.reshape(w, [BLOCK_N, 64]), 128 * (t // 32) + 32 * QUARTER + t % 32


@triton.jit
def legacy_part(blocks, num_left, PART: tl.constexpr, BYTES: tl.constexpr, QS: tl.constexpr,
                QH: tl.constexpr, MIN: tl.constexpr, ZERO: tl.constexpr, BLOCK_N: tl.constexpr):  # fmt: skip
    """kquant_part for the 32-element types: 8 blocks from byte pointers blocks [BLOCK_N], of
    which num_left (may be fewer than 8 at the end of a row) exist; the others read as zeros.
    Q8_0 (ZERO -1): one part, element 32 b + i of block b, P = 256. The others: part 0 is each
    block's low nibbles (elements 32 b + i, i < 16), part 1 its high ones (32 b + 16 + i); P =
    128; qh's bit e is element e's fifth. Also returns which columns exist."""
    b = tl.arange(0, 8)
    exists = b < num_left
    block = blocks[:, None] + tl.where(exists, b, 0)[None, :] * BYTES  # [BLOCK_N, 8]
    d = f16_at(block)
    if ZERO < 0:  # Q8_0: d, qs[32] int8
        i = tl.arange(0, 32)
        q = tl.load((block[:, :, None] + QS + i[None, None, :]).to(tl.pointer_type(tl.int8)))
        w = d[:, :, None] * q.to(tl.float32)
        t = tl.arange(0, 256)
        return tl.reshape(w, [BLOCK_N, 256]), t, (t // 32) < num_left
    else:
        i = tl.arange(0, 16)
        q = (tl.load(block[:, :, None] + QS + i[None, None, :]).to(tl.int32) >> (4 * PART)) & 15
        if QH != 0:
            e = 16 * PART + i  # the element within its block
            high = tl.load(block[:, :, None] + QH + (e // 8)[None, None, :]).to(tl.int32)
            q = q | (((high >> (e % 8)[None, None, :]) & 1) << 4)
        w = d[:, :, None] * (q - ZERO).to(tl.float32)
        if MIN:
            w = w + f16_at(block + 2)[:, :, None]
        t = tl.arange(0, 128)
        return tl.reshape(w, [BLOCK_N, 128]), 32 * (t // 16) + 16 * PART + t % 16, (t // 16) < num_left


@triton.jit
def step_part(row, step, num_blocks, PART: tl.constexpr, QTYPE: tl.constexpr, BYTES: tl.constexpr,
              QS: tl.constexpr, QH: tl.constexpr, MIN: tl.constexpr, ZERO: tl.constexpr,
              BLOCK_N: tl.constexpr, PLANES: tl.constexpr = False):  # fmt: skip
    """(w, cols, exists): part PART of step `step` of the rows at byte pointers row [BLOCK_N]
    (num_blocks blocks a row): float32 [BLOCK_N, P] as ggml dequantises it, each column's
    element within the step [P], and whether it exists (K's last step may be partial). The
    constexprs are a format's kernel_args(); PLANES: Q6_K in planes (gguf_planes)."""
    if QTYPE == 14:
        base, ql_at, qh_at, sc_at, d_at = q6k_fields(row, step, num_blocks, PLANES)
        w, cols = q6k_part(base, ql_at, qh_at, sc_at, d_at, PART, BLOCK_N)
        return w, cols, cols < 256
    elif QTYPE >= 12:
        w, cols = kquant_part(row + step * BYTES, PART, QTYPE, BLOCK_N)
        return w, cols, cols < 256
    else:
        return legacy_part(row + step * 8 * BYTES, num_blocks - step * 8, PART, BYTES, QS, QH, MIN,
                           ZERO, BLOCK_N)  # fmt: skip


@triton.jit
def q45k_chunk(block, c: tl.constexpr, QTYPE: tl.constexpr):
    """Chunk c (< 4) of the Q4_K / Q5_K super-blocks at byte pointers block [BLOCK_N]: the
    quants of its two sub-blocks, q_lo [BLOCK_N, 32] (elements 64 c + j) and q_hi (64 c + 32 +
    j), int32 in [0, 32), and each sub-block's factors, d1 = d * scale and m1 = dmin * min
    (float32 [BLOCK_N]): a weight is d1 * q - m1. kquant_part's values, by sub-block, so that a
    product can apply the factors to sums of q * x instead of to every weight."""
    j = tl.arange(0, 32)
    QS: tl.constexpr = 48 if QTYPE == 13 else 16
    qs = tl.load(block[:, None] + QS + 32 * c + j[None, :]).to(tl.int32)
    q_lo = qs & 15
    q_hi = qs >> 4
    if QTYPE == 13:  # bit s of qh[j] is sub-block s's fifth
        qh = tl.load(block[:, None] + 16 + j[None, :]).to(tl.int32)
        q_lo = q_lo | (((qh >> (2 * c)) & 1) << 4)
        q_hi = q_hi | (((qh >> (2 * c + 1)) & 1) << 4)
    d = f16_at(block)
    dmin = f16_at(block + 2)
    scales = block + 4
    # sub-blocks 2c and 2c + 1's 6-bit scales and mins (ggml's get_scale_min_k4)
    if c < 2:
        sc_lo = tl.load(scales + 2 * c).to(tl.int32) & 63
        mn_lo = tl.load(scales + 2 * c + 4).to(tl.int32) & 63
        sc_hi = tl.load(scales + 2 * c + 1).to(tl.int32) & 63
        mn_hi = tl.load(scales + 2 * c + 5).to(tl.int32) & 63
    else:
        s = 2 * c
        # get_scale_min_k4's q[j], q[j + 4] and q[j - 4] for j = s, then for j = s + 1
        a_lo = tl.load(scales + s).to(tl.int32)
        b_lo = tl.load(scales + s + 4).to(tl.int32)
        c_lo = tl.load(scales + s - 4).to(tl.int32)
        sc_lo = (b_lo & 15) | ((c_lo >> 6) << 4)
        mn_lo = (b_lo >> 4) | ((a_lo >> 6) << 4)
        a_hi = tl.load(scales + s + 1).to(tl.int32)
        b_hi = tl.load(scales + s + 5).to(tl.int32)
        c_hi = tl.load(scales + s - 3).to(tl.int32)
        sc_hi = (b_hi & 15) | ((c_hi >> 6) << 4)
        mn_hi = (b_hi >> 4) | ((a_hi >> 6) << 4)
    d1_lo = d * sc_lo.to(tl.float32)
    d1_hi = d * sc_hi.to(tl.float32)
    m1_lo = dmin * mn_lo.to(tl.float32)
    m1_hi = dmin * mn_hi.to(tl.float32)
    return q_lo, q_hi, d1_lo, m1_lo, d1_hi, m1_hi


@triton.jit
def _store_part(out_ptr, offs_n, mask_n, k, step, w, cols, exists):
    out = out_ptr + offs_n[:, None].to(tl.int64) * k + step * 256 + cols[None, :]
    tl.store(out, w.to(out_ptr.dtype.element_ty), mask=mask_n[:, None] & exists[None, :])


@triton.jit
def _dequantize_kernel(
    out_ptr, w_ptr, n, k, num_blocks, row_bytes,
    QTYPE: tl.constexpr, BYTES: tl.constexpr, QS: tl.constexpr, QH: tl.constexpr,
    MIN: tl.constexpr, ZERO: tl.constexpr, PARTS: tl.constexpr, BLOCK_N: tl.constexpr,
    LOWP: tl.constexpr, ASM: tl.constexpr, WORDS: tl.constexpr, PLANES: tl.constexpr,
):  # fmt: skip
    """One program: BLOCK_N rows' step program_id(1), part by part (LOWP: a K-quant in the
    output's 16-bit dtype, as the few-rows product dequantises it; PLANES: Q6_K in planes)."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < n
    row = w_ptr + tl.where(mask_n, offs_n, 0).to(tl.int64) * row_bytes  # past n: row 0's bytes
    step = tl.program_id(1)
    if LOWP:
        block = row + step * BYTES
        dtype = out_ptr.dtype.element_ty
        every = tl.full([128], 1, tl.int1)
        if QTYPE != 14:
            w_lo, cols_lo, w_hi, cols_hi = q45k_step_lowp(block, QTYPE, dtype, ASM, WORDS, BLOCK_N)
            _store_part(out_ptr, offs_n, mask_n, k, step, w_lo, cols_lo, every)
            _store_part(out_ptr, offs_n, mask_n, k, step, w_hi, cols_hi, every)
        else:
            base, ql_at, qh_at, sc_at, d_at = q6k_fields(row, step, num_blocks, PLANES)
            ql_even, ql_odd, qh = q6k_bytes(base, ql_at, qh_at)
            for quarter in tl.static_range(4):
                w, cols = q6k_quarter_lowp(base, sc_at, d_at, ql_even, ql_odd, qh, quarter, dtype, ASM, BLOCK_N)
                _store_part(out_ptr, offs_n, mask_n, k, step, w, cols, cols < 256)
    else:
        for part in tl.static_range(PARTS):
            w, cols, exists = step_part(row, step, num_blocks, part, QTYPE, BYTES, QS, QH, MIN, ZERO, BLOCK_N, PLANES)
            _store_part(out_ptr, offs_n, mask_n, k, step, w, cols, exists)


LOWP_TYPES = ("Q4_K", "Q5_K", "Q6_K")  # the types LOWP (above) covers


def lowp_args(qtype: str, dtype: torch.dtype, lowp: bool, words: bool) -> dict[str, bool]:
    """The LOWP / ASM / WORDS constexprs of a kernel reading qtype in dtype: LOWP for a
    K-quant in a 16-bit dtype when lowp, its bits by inline PTX in bfloat16 on a GPU."""
    low = lowp and qtype in LOWP_TYPES and dtype in (torch.float16, torch.bfloat16)
    asm = low and dtype == torch.bfloat16 and not triton.knobs.runtime.interpret
    return {"LOWP": low, "ASM": asm, "WORDS": low and words}


@dataclass(frozen=True)
class WeightLayout:
    """How a quantised weight's rows lie in memory (check_weight)."""

    fmt: BlockFormat
    num_blocks: int  # blocks a row
    row_bytes: int  # bytes from one row to the next
    planes: bool  # Q6_K in planes (mmserve.kernels.gguf_planes), not the file's blocks


def check_weight(name: str, blocks: torch.Tensor, qtype: str) -> WeightLayout:
    """blocks is qtype's blocks uint8 [N, K // elements, bytes] (check_blocks) or, Q6_K, its
    planes [N, row bytes] (gguf_planes.check_planes)."""
    if qtype == "Q6_K" and is_planes(blocks):
        num_blocks = check_planes(name, blocks)
        return WeightLayout(FORMATS[qtype], num_blocks, blocks.shape[1], True)
    fmt = check_blocks(name, blocks, qtype)
    return WeightLayout(fmt, blocks.shape[1], blocks.shape[1] * fmt.bytes, False)


def gguf_dequantize(
    blocks: torch.Tensor, qtype: str, dtype: torch.dtype, lowp: bool = False, words: bool = True
) -> torch.Tensor:
    """blocks uint8 [N, K // elements, bytes] of qtype (or Q6_K's planes) -> the weight [N, K]
    in dtype (lowp: a K-quant in a 16-bit dtype dequantised in that dtype; words: its scales
    read as words)."""
    layout = check_weight("blocks", blocks, qtype)
    fmt = layout.fmt
    check_float("dtype", torch.empty(0, dtype=dtype))
    check_same_device(blocks=blocks)
    n, k = blocks.shape[0], layout.num_blocks * fmt.elements
    out = torch.empty((n, k), dtype=dtype, device=blocks.device)
    if n and k:
        low = lowp_args(qtype, dtype, lowp, words)
        block_n = 64 if low["LOWP"] else 16
        _dequantize_kernel[(triton.cdiv(n, block_n), triton.cdiv(k, STEP))](
            out, blocks, n, k, layout.num_blocks, layout.row_bytes, **fmt.kernel_args(),
            PARTS=STEP_PARTS[fmt.type_id], BLOCK_N=block_n, **low, PLANES=layout.planes,
        )  # fmt: skip
    return out


def gguf_dequantize_ref(blocks: torch.Tensor, qtype: str) -> torch.Tensor:
    """float32 [N, K] by the gguf package's dequantiser (numpy, on the CPU): the ground truth
    of the kernels, and the CPU path of mmserve.models.gguf_linear.GgufLinear. (Q6_K's planes:
    of the blocks they hold.)"""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    if check_weight("blocks", blocks, qtype).planes:
        blocks = q6k_blocks(blocks)
    raw = blocks.detach().cpu().reshape(blocks.shape[0], -1).numpy()
    array = dequantize(raw, GGMLQuantizationType[qtype])
    return torch.from_numpy(array.copy()).to(blocks.device)
