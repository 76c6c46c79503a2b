"""GGUF's quantised blocks, read as they lie in the file: the formats, a Triton function that
dequantises a tile of them, a kernel that dequantises a whole weight, and the reference.

A quantised weight [N, K] is kept as uint8 [N, K // block_elements, block_bytes]: each row of
the matrix is its row of GGUF blocks, unchanged (ggml's block_q4_0 ... block_q6_K structs,
little-endian). The formats, by ggml's type ids:
- 32-element blocks ("legacy"): Q4_0 (d, 16 bytes of nibbles: (q - 8) d), Q4_1 (d, m: q d + m),
  Q5_0 / Q5_1 (the same with a fifth bit per element in 4 bytes qh), Q8_0 (d, 32 int8).
- 256-element super-blocks (K-quants): Q4_K / Q5_K (d, dmin, 8 sub-blocks of 32 with 6-bit
  scales and mins packed in 12 bytes: q d sc - dmin m), Q6_K (16 sub-blocks of 16 with int8
  scales, 6-bit q - 32, d last).
Every element is dequantised from its own bytes (a gather: each byte and scale is loaded once
per element that uses it, from the cache after the first), in float32, as ggml computes it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from mmserve.kernels._common import check_float, check_ndim, check_same_device


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


@triton.jit
def _f16(ptr):
    """The little-endian float16 at ptr (a tile of byte pointers), as float32."""
    lo = tl.load(ptr).to(tl.uint16)
    hi = tl.load(ptr + 1).to(tl.uint16)
    return (lo | (hi << 8)).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _byte(ptr):
    return tl.load(ptr).to(tl.int32)


@triton.jit
def _legacy(row, k, BYTES: tl.constexpr, QS: tl.constexpr, QH: tl.constexpr, MIN: tl.constexpr,
            ZERO: tl.constexpr):  # fmt: skip
    """Weights at element k of the rows at byte pointers row (broadcastable tiles), float32.
    QS / QH: byte offsets of the quants and the fifth bits in a block (QH 0: none); MIN: a
    block has a min after d; ZERO: what is subtracted from q. Q8_0 is QS 2 and ZERO -1."""
    block = row + (k // 32) * BYTES
    j = k % 32
    d = _f16(block)
    if ZERO < 0:  # Q8_0: qs[32] int8
        q = _byte(block + QS + j)
        q = q - ((q & 128) << 1)
    else:  # element j: the low nibble of qs[j] for j < 16, the high one of qs[j - 16] after
        q = (_byte(block + QS + j % 16) >> ((j // 16) * 4)) & 15
        if QH != 0:  # bit j of the little-endian 32-bit qh is element j's fifth
            q = q | (((_byte(block + QH + j // 8) >> (j % 8)) & 1) << 4)
        q = q - ZERO
    w = d * q.to(tl.float32)
    if MIN:
        w = w + _f16(block + 2)
    return w


@triton.jit
def _k_quant(row, k, QTYPE: tl.constexpr, BYTES: tl.constexpr):
    """As _legacy, for the 256-element super-blocks (QTYPE 12 Q4_K, 13 Q5_K, 14 Q6_K)."""
    block = row + (k // 256) * BYTES
    i = k % 256
    if QTYPE == 14:  # Q6_K: ql[128], qh[64], scales[16] int8, d
        half = i // 128
        quarter = (i % 128) // 32
        lane = i % 32
        low = _byte(block + 64 * half + lane + 32 * (quarter % 2)) >> (4 * (quarter // 2))
        high = (_byte(block + 128 + 32 * half + lane) >> (2 * quarter)) & 3
        q = ((low & 15) | (high << 4)) - 32
        sc = _byte(block + 192 + 8 * half + lane // 16 + 2 * quarter)
        sc = sc - ((sc & 128) << 1)
        w = (_f16(block + 208) * sc.to(tl.float32)) * q.to(tl.float32)
    else:
        # Q4_K / Q5_K: d, dmin, scales[12], (Q5_K: qh[32]), qs[128]. Sub-block sub = i // 32
        # has a 6-bit scale and min: bytes sub and sub + 4 for sub < 4, else over three bytes
        sub = i // 32
        s_a = _byte(block + 4 + sub)
        s_b = _byte(block + 8 + sub)
        s_c = _byte(block + 4 + tl.maximum(sub - 4, 0))
        low_sub = sub < 4
        sc = tl.where(low_sub, s_a & 63, (s_b & 15) | ((s_c >> 6) << 4))
        mn = tl.where(low_sub, s_b & 63, (s_b >> 4) | ((s_a >> 6) << 4))
        at = 32 * (i // 64) + i % 32  # elements i and i + 32 share a byte of qs
        if QTYPE == 13:  # Q5_K: qs after qh, and bit sub of qh[i % 32] is the fifth
            q = (_byte(block + 48 + at) >> (4 * (sub % 2))) & 15
            q = q | (((_byte(block + 16 + i % 32) >> sub) & 1) << 4)
        else:
            q = (_byte(block + 16 + at) >> (4 * (sub % 2))) & 15
        d = _f16(block) * sc.to(tl.float32)
        w = d * q.to(tl.float32) - _f16(block + 2) * mn.to(tl.float32)
    return w


@triton.jit
def dequant_tile(w_ptr, offs_n, offs_k, mask, row_bytes, QTYPE: tl.constexpr, BYTES: tl.constexpr,
                 QS: tl.constexpr, QH: tl.constexpr, MIN: tl.constexpr, ZERO: tl.constexpr):  # fmt: skip
    """float32 [BLOCK_N, BLOCK_K]: W[offs_n, offs_k] of the blocks at w_ptr; 0 outside mask
    (out-of-range rows and columns read row 0 / column 0 instead of past the end). The
    constexprs are a format's kernel_args()."""
    n = tl.where(mask, offs_n[:, None], 0)
    k = tl.where(mask, offs_k[None, :], 0)
    row = w_ptr + n.to(tl.int64) * row_bytes
    if QTYPE >= 12:
        w = _k_quant(row, k, QTYPE, BYTES)
    else:
        w = _legacy(row, k, BYTES, QS, QH, MIN, ZERO)
    return tl.where(mask, w, 0.0)


@triton.jit
def _dequantize_kernel(
    out_ptr, w_ptr, n, k, row_bytes,
    QTYPE: tl.constexpr, BYTES: tl.constexpr, QS: tl.constexpr, QH: tl.constexpr,
    MIN: tl.constexpr, ZERO: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = (offs_n[:, None] < n) & (offs_k[None, :] < k)
    w = dequant_tile(w_ptr, offs_n, offs_k, mask, row_bytes, QTYPE, BYTES, QS, QH, MIN, ZERO)
    out = out_ptr + offs_n[:, None].to(tl.int64) * k + offs_k[None, :]
    tl.store(out, w.to(out_ptr.dtype.element_ty), mask=mask)


def gguf_dequantize(blocks: torch.Tensor, qtype: str, dtype: torch.dtype) -> torch.Tensor:
    """blocks uint8 [N, K // elements, bytes] of qtype -> the weight [N, K] in dtype."""
    fmt = check_blocks("blocks", blocks, qtype)
    check_float("dtype", torch.empty(0, dtype=dtype))
    check_same_device(blocks=blocks)
    n, k = blocks.shape[0], blocks.shape[1] * fmt.elements
    out = torch.empty((n, k), dtype=dtype, device=blocks.device)
    if n and k:
        block_n, block_k = 16, 256
        grid = (triton.cdiv(n, block_n), triton.cdiv(k, block_k))
        _dequantize_kernel[grid](
            out, blocks, n, k, blocks.shape[1] * fmt.bytes,
            **fmt.kernel_args(), BLOCK_N=block_n, BLOCK_K=block_k,
        )  # fmt: skip
    return out


def gguf_dequantize_ref(blocks: torch.Tensor, qtype: str) -> torch.Tensor:
    """float32 [N, K] by the gguf package's dequantiser (numpy, on the CPU): the ground truth
    of the kernels, and the CPU path of mmserve.models.gguf_linear.GgufLinear."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    check_blocks("blocks", blocks, qtype)
    raw = blocks.detach().cpu().reshape(blocks.shape[0], -1).numpy()
    array = dequantize(raw, GGMLQuantizationType[qtype])
    return torch.from_numpy(array.copy()).to(blocks.device)
