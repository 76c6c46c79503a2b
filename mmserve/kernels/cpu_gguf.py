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
Every type on AVX-512 with VBMI (gguf_panel_supported) takes the library's outer-product
path from 2 rows on, at any row count: 16 channels dequantised transposed, multiplied with 16
rows' sums held in registers (up to 16 rows each block as it is dequantised), faster than
torch.matmul at every size measured on AMD Zen 4 / Zen 5 (SmolLM2's layers: 180 against 120-145
GFLOP/s at 256-512 rows, 178 against 164 at 2,048; Q4_K / Q6_K layers of a 1k-wide model at 512
rows 190 / 183 against 182 / 158). On Intel processors it lost at every size (use_panels;
measured before it multiplied each block as it is dequantised and took the K-quants:
scripts/bench_cpu_panels.py measures it again): up to MAX_ROWS to the library's 4 x 4 tiles
(mmserve/kernels/cpu/gguf_gemm.c gives the figures), past it to torch.matmul, whose float32
GEMM (MKL, torch's BLAS on x86-64) runs kernels tuned for them, dequantisation included
(SmolLM2's layers on 2 cores of a Xeon with AVX-512 and AMX: 2,048 rows 47 against 80 ms, 512
rows 12.5 against 16.8, 128 rows 4.0 against 4.1).
Where the library is not available (cpu_lib) the loader keeps the other path: the GGUF
dequantised once at load.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from mmserve.kernels import cpu_lib
from mmserve.kernels._common import matmul_in_column_chunks
from mmserve.kernels.cpu_lib import require
from mmserve.kernels.gguf_blocks import FORMATS, BlockFormat, check_blocks

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
    types its outer-product path takes, where use_panels), else W dequantised CHUNK_ELEMENTS at
    a time and torch.matmul."""
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
    panels = use_panels()
    if m > MAX_ROWS and not (panels and lib.gguf_panel_supported(type_id)):
        out = matmul_in_column_chunks(
            xf, n, CHUNK_ELEMENTS, lambda cols: gguf_dequantize_cpu(blocks[cols], qtype, lib).t()
        )
    else:
        if xf.stride(1) != 1:  # (rows may be apart: the library takes x's row stride)
            xf = xf.contiguous()
        out = xf.new_empty((m, n))
        if m and n:
            status = lib.gguf_gemm_f32(type_id, torch.get_num_threads(), xf.data_ptr(), m, xf.shape[1],
                                       xf.stride(0), blocks.data_ptr(), n, out.data_ptr(), n, panels)  # fmt: skip
            if status:
                raise RuntimeError(f"gguf_gemm_f32 failed ({status})")
    return out if is_float else out.to(x.dtype)


# whether the outer-product path runs where it is built: None by the
# processor (use_panels); tests set it to take either path here
PANELS: bool | None = None


def use_panels() -> bool:
    """Whether the outer-product path runs (where the library has it):
    everywhere but on Intel processors with torch's BLAS MKL (see the module's docstring),
    unless PANELS says."""
    if PANELS is not None:
        return PANELS
    return not _mkl_on_intel()


@functools.cache
def _mkl_on_intel() -> bool:
    return cpu_lib.cpu_vendor() == "GenuineIntel" and torch.backends.mkl.is_available()


def q8_supported(qtype: str, lib: ctypes.CDLL | None = None) -> bool:
    """Whether the library multiplies qtype with int8 activations here (every supported type,
    on AVX-512 with VNNI: mmserve/kernels/cpu/gguf_q8.c)."""
    lib = lib or cpu_lib.library()
    fmt = FORMATS.get(qtype)
    return lib is not None and fmt is not None and bool(lib.gguf_q8_supported(fmt.type_id))


def q8_pack(blocks: torch.Tensor, qtype: str, lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """qtype's blocks [N, K // elements, bytes] -> the int8-activation product's panels (uint8,
    1-D)."""
    fmt = _check(blocks, qtype, None)
    lib = require(lib)
    n, k = blocks.shape[0], blocks.shape[1] * fmt.elements
    size = lib.gguf_q8_packed_bytes(fmt.type_id, n, k)
    if size < 0 or not lib.gguf_q8_supported(fmt.type_id):
        raise ValueError(f"{qtype} has no int8-activation product on this machine")
    out = torch.empty(size, dtype=torch.uint8)
    if lib.gguf_q8_pack(fmt.type_id, torch.get_num_threads(), blocks.data_ptr(), n, k, out.data_ptr()):
        raise RuntimeError("gguf_q8_pack failed")
    return out


@functools.cache
def _q8_bytes(lib: ctypes.CDLL, type_id: int, n: int, k: int) -> int:
    """Bytes of a weight [n, k] packed by q8_pack (-1: not whole blocks)."""
    return int(lib.gguf_q8_packed_bytes(type_id, n, k))


def _q8_k(lib: ctypes.CDLL, type_id: int, n: int, nbytes: int) -> int | str:
    """The K of a packed weight of n channels and nbytes (for an error message)."""
    per_32 = _q8_bytes(lib, type_id, n, 256) // 8  # (256: whole blocks of every type)
    return nbytes // per_32 * 32 if per_32 > 0 and nbytes % per_32 == 0 else "unknown"


def q8_gemm(
    x: torch.Tensor, packed: torch.Tensor, type_id: int, n: int, lib: ctypes.CDLL | None = None
) -> torch.Tensor:
    """x [M, K] (a float CPU tensor, K whole blocks) against the weight q8_pack packed (N output
    channels, type_id its GGUF type), x rounded to int8 by 32 as _common.q8_round_trip rounds it:
    [M, N] in x's dtype, float32 sums."""
    lib = require(lib)
    if x.dim() != 2 or packed.numel() != _q8_bytes(lib, type_id, n, x.shape[1]):
        raise ValueError(
            f"x must be [M, K] with K = the packed weight's (of {n} channels), got {list(x.shape)}; "
            f"K = {_q8_k(lib, type_id, n, packed.numel())}"
        )
    xf = x if x.dtype == torch.float32 and x.stride(1) == 1 else x.float().contiguous()
    m = xf.shape[0]
    out = xf.new_empty((m, n))
    if m and n:
        status = lib.gguf_q8_gemm(type_id, torch.get_num_threads(), xf.data_ptr(), m, xf.shape[1], xf.stride(0),
                                  packed.data_ptr(), n, out.data_ptr(), n)  # fmt: skip
        if status:
            raise RuntimeError(f"gguf_q8_gemm failed ({status})")
    return out if x.dtype == torch.float32 else out.to(x.dtype)
