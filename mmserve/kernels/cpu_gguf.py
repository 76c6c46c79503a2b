"""GGUF blocks multiplied on the CPU without a float copy of the weight, by the CPU's C library
(mmserve.kernels.cpu_lib; mmserve/kernels/cpu/gguf_*.c).

A CPU decode step is bound by the weight bytes it streams, and a float32 weight is 6.4 times
the bytes of its Q4_1 blocks (SmolLM2-135M: 538 MB against 85). The library dequantises each
output channel's blocks exactly (bit-equal to the gguf package's reference, so the weights are
the file's, as the dequantised-at-load path has them) into a buffer the size of a few rows and
multiplies it there, float32 sums.

Up to MAX_ROWS rows (decode steps, short prompts) run that product; more dequantise the weight
in chunks and multiply with torch.matmul, which is faster there. One row (a decode step of
one request) skips the buffer: each block's (a K-quant's: sub-block's) integers times x, scaled
by its d once, plus its m times x's block sum; the same weights, the sums in another order.
The 32-element types on AVX-512 with VBMI (gguf_panel_supported) take the library's
outer-product path from 4 rows on, at any row count: 16 channels dequantised transposed,
multiplied with 16 rows' sums held in registers, faster than torch.matmul at every size
measured (SmolLM2's layers: 180 against 120-145 GFLOP/s at 256-512 rows, 178 against 164 at
2,048).
Where the library is not available (cpu_lib) the loader keeps the other path: the GGUF
dequantised once at load.
"""

from __future__ import annotations

import ctypes

import torch

from mmserve.kernels._common import matmul_in_column_chunks
from mmserve.kernels.cpu_lib import require
from mmserve.kernels.gguf_blocks import BlockFormat, check_blocks

# more rows than this: dequantised in chunks + torch.matmul. SmolLM2's layers, 2 cores: the
# library's product costs about what torch.matmul on float32 weights does up to 128 rows
# (64: 114 against 104 ms, 128: 228 against 245), and loses above (512: 891 against 752)
MAX_ROWS = 128
CHUNK_ELEMENTS = 1 << 22  # the many-rows path dequantises at most this many weights at a time


def _check(blocks: torch.Tensor, qtype: str, k: int | None) -> BlockFormat:
    """blocks are qtype's (uint8 [N, K // e, bytes of a qtype block], contiguous, on the CPU:
    the library reads exactly that many bytes), for K = k if given; returns qtype's format."""
    fmt = check_blocks("blocks", blocks, qtype)
    if blocks.device.type != "cpu":
        raise ValueError(f"blocks must be on the CPU, got {blocks.device}")
    if k is not None and blocks.shape[1] * fmt.elements != k:
        raise ValueError(f"x must be [M, K] with K = {blocks.shape[1] * fmt.elements}, got K = {k}")
    return fmt


def check(blocks: torch.Tensor, qtype: str, k: int) -> int:
    """Checks blocks as gguf_gemm_cpu does for x of K = k; returns qtype's id for gemm_checked."""
    return _check(blocks, qtype, k).type_id


def gguf_dequantize_cpu(blocks: torch.Tensor, qtype: str, lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """uint8 blocks [N, K // e, bytes] -> float32 [N, K], bit-equal to the gguf package. lib:
    another build of the library (tests), else this machine's."""
    fmt = _check(blocks, qtype, None)
    k = blocks.shape[1] * fmt.elements
    out = torch.empty(blocks.shape[0], k, dtype=torch.float32)
    status = require(lib).gguf_dequant_f32(fmt.type_id, torch.get_num_threads(), blocks.data_ptr(),
                                           blocks.shape[0], k, out.data_ptr())  # fmt: skip
    if status:
        raise RuntimeError(f"gguf_dequant_f32 failed ({status})")
    return out


def gguf_gemm_cpu(
    x: torch.Tensor, blocks: torch.Tensor, qtype: str, lib: ctypes.CDLL | None = None
) -> torch.Tensor:
    """x [M, K] @ W^T -> [M, N] in x's dtype (computed in float32), W the qtype weight in
    blocks [N, K // e, bytes]: the library's product up to MAX_ROWS rows (at any count for the
    types its outer-product path takes), else W dequantised CHUNK_ELEMENTS at a time and
    torch.matmul."""
    if x.dim() != 2 or x.device.type != "cpu" or not x.is_floating_point():
        raise ValueError(f"x must be a float [M, K] CPU tensor, got {x.dtype} {list(x.shape)} on {x.device}")
    return gemm_checked(x, blocks, qtype, _check(blocks, qtype, x.shape[1]).type_id, lib)


def gemm_checked(
    x: torch.Tensor, blocks: torch.Tensor, qtype: str, type_id: int, lib: ctypes.CDLL | None = None
) -> torch.Tensor:
    """gguf_gemm_cpu for inputs already checked (x a float [M, K] CPU tensor; blocks qtype's,
    type_id its id, K whole blocks): a layer that checked its blocks at its first product calls
    this every step (the checks took about 4 us a call in a profile; SmolLM2 makes 121 a step)."""
    lib = require(lib)
    is_float = x.dtype == torch.float32
    xf = x if is_float else x.float()
    m, n = xf.shape[0], blocks.shape[0]
    if m > MAX_ROWS and not lib.gguf_panel_supported(type_id):
        out = matmul_in_column_chunks(
            xf, n, CHUNK_ELEMENTS, lambda cols: gguf_dequantize_cpu(blocks[cols], qtype, lib).t()
        )
    else:
        if xf.stride(1) != 1:  # (rows may be apart: the library takes x's row stride)
            xf = xf.contiguous()
        out = xf.new_empty((m, n))
        if m and n:
            status = lib.gguf_gemm_f32(type_id, torch.get_num_threads(), xf.data_ptr(), m, xf.shape[1],
                                       xf.stride(0), blocks.data_ptr(), n, out.data_ptr(), n)  # fmt: skip
            if status:
                raise RuntimeError(f"gguf_gemm_f32 failed ({status})")
    return out if is_float else out.to(x.dtype)
