"""GGUF blocks multiplied on the CPU without a float copy of the weight: a small C library
(mmserve/kernels/cpu/), built at first use by the machine's C compiler and cached.

A CPU decode step is bound by the weight bytes it streams, and a float32 weight is 6.4 times
the bytes of its Q4_1 blocks (SmolLM2-135M: 538 MB against 85). The library dequantises each
output channel's blocks exactly (bit-equal to the gguf package's reference, so the weights are
the file's, as the dequantised-at-load path has them) into a buffer the size of a few rows and
multiplies it there, float32 sums; its threads are torch's own OpenMP runtime.

Up to MAX_ROWS rows (decode steps, short prompts) run that product; more dequantise the weight
in chunks and multiply with torch.matmul, which is faster there. Where the
library cannot be built (no C compiler, no OpenMP, torch not on OpenMP, MMSERVE_CPU_KERNELS=0)
or is not vectorised (x86-64 with AVX2 or AVX-512 only: the generic code was measured slower
than float32 weights) available() is False and the loader keeps the other path: the GGUF
dequantised once at load.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from mmserve import envs
from mmserve.kernels._common import matmul_in_column_chunks

logger = logging.getLogger(__name__)

SOURCE_DIR = Path(__file__).resolve().parent / "cpu"
# ggml's type ids, as the library's switch takes them (gguf_cpu.h)
TYPE_IDS = {"Q4_0": 2, "Q4_1": 3, "Q5_0": 6, "Q5_1": 7, "Q8_0": 8, "Q4_K": 12, "Q5_K": 13, "Q6_K": 14}
# more rows than this: dequantised in chunks + torch.matmul. SmolLM2's layers, 2 cores: the
# library's product costs about what torch.matmul on float32 weights does up to 128 rows
# (64: 114 against 104 ms, 128: 228 against 245), and loses above (512: 891 against 752)
MAX_ROWS = 128
CHUNK_ELEMENTS = 1 << 22  # the many-rows path dequantises at most this many weights at a time
_I64 = ctypes.c_int64
_PTR = ctypes.c_void_p


@functools.cache
def library() -> ctypes.CDLL | None:
    """The library built for this machine, or None where it cannot be had (the reason logged
    once)."""
    if not envs.cpu_kernels_enabled():
        return None
    if "OpenMP" not in torch.__config__.parallel_info().split("parallel backend:")[-1]:
        logger.info("CPU GGUF kernels off: torch's parallel backend is not OpenMP")
        return None
    try:
        lib = load(build(envs.cache_dir() / "cpu-kernels"))
    except (OSError, subprocess.SubprocessError) as e:
        logger.warning("CPU GGUF kernels off (GGUF weights dequantised at load): %s", e)
        return None
    if not lib.gguf_cpu_vectorised():
        logger.info("CPU GGUF kernels off: no AVX2 or AVX-512 here (the generic build is slower)")
        return None
    return lib


def available() -> bool:
    return library() is not None


def load(path: Path) -> ctypes.CDLL:
    """A built library with its functions' signatures set."""
    lib = ctypes.CDLL(str(path))
    for fn in (lib.gguf_gemm_f32, lib.gguf_dequant_f32, lib.gguf_cpu_vectorised):
        fn.restype = ctypes.c_int
    lib.gguf_gemm_f32.argtypes = [ctypes.c_int, ctypes.c_int, _PTR, _I64, _I64, _I64, _PTR, _I64, _PTR, _I64]
    lib.gguf_dequant_f32.argtypes = [ctypes.c_int, ctypes.c_int, _PTR, _I64, _I64, _PTR]
    return lib


def build(folder: Path, march: str = "native") -> Path:
    """Compiles the sources for -march=`march` into folder, once per source, compiler, target
    and processor; concurrent builders each write their own file and rename it."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise OSError("no C compiler (cc) on PATH")
    version = subprocess.run([cc, "--version"], check=True, capture_output=True, text=True, timeout=30).stdout
    sources = sorted(SOURCE_DIR.glob("*.[ch]"))
    key = hashlib.sha256()
    for part in (version, march, platform.machine(), _cpu_flags(), *(p.read_text() for p in sources)):
        key.update(part.encode())
    target = folder / f"gguf-{key.hexdigest()[:16]}.so"
    if target.exists():
        return target
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder) as tmp:
        objects = []
        for source in (p for p in sources if p.suffix == ".c"):
            # the dequantisation rounds as the reference does: no fused multiply-add
            contract = "off" if source.stem == "gguf_dequant" else "fast"
            obj = Path(tmp) / f"{source.stem}.o"
            _compile([cc, "-O3", f"-march={march}", "-fPIC", "-fopenmp", f"-ffp-contract={contract}",
                      "-Wno-psabi", "-c", str(source), "-o", str(obj)])  # fmt: skip
            objects.append(str(obj))
        built = Path(tmp) / "lib.so"
        _compile([cc, "-shared", "-fopenmp", *objects, "-o", str(built)])
        os.replace(built, target)
    return target


def _compile(command: list[str]) -> None:
    done = subprocess.run(command, check=False, capture_output=True, text=True, timeout=300)
    if done.returncode:
        raise OSError(f"{Path(command[0]).name} failed: {done.stderr.strip()[-500:]}")


def _cpu_flags() -> str:
    """The processor's feature flags (-march=native builds for them), where Linux lists them."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor()
    return next((line for line in info.splitlines() if line.startswith(("flags", "Features"))), "")


def _check(blocks: torch.Tensor, qtype: str, k: int) -> None:
    if qtype not in TYPE_IDS:
        raise ValueError(f"qtype {qtype!r} is not one of {list(TYPE_IDS)}")
    if blocks.device.type != "cpu" or blocks.dtype != torch.uint8 or blocks.dim() != 3:
        raise ValueError(f"blocks must be uint8 [N, blocks, bytes] on the CPU, got {blocks.dtype} {list(blocks.shape)}")
    if not blocks.is_contiguous():
        raise ValueError("blocks must be contiguous")
    elements = 256 if qtype.endswith("_K") else 32
    if blocks.shape[1] * elements != k:
        raise ValueError(f"x must be [M, K] with K = {blocks.shape[1] * elements}, got K = {k}")


def _lib(lib: ctypes.CDLL | None) -> ctypes.CDLL:
    lib = lib or library()
    if lib is None:
        raise RuntimeError("the CPU GGUF kernels are not available on this machine")
    return lib


def gguf_dequantize_cpu(blocks: torch.Tensor, qtype: str, lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """uint8 blocks [N, K // e, bytes] -> float32 [N, K], bit-equal to the gguf package. lib:
    another build of the library (tests), else this machine's."""
    k = blocks.shape[1] * (256 if qtype.endswith("_K") else 32)
    _check(blocks, qtype, k)
    out = torch.empty(blocks.shape[0], k, dtype=torch.float32)
    status = _lib(lib).gguf_dequant_f32(TYPE_IDS[qtype], torch.get_num_threads(), blocks.data_ptr(),
                                     blocks.shape[0], k, out.data_ptr())  # fmt: skip
    if status:
        raise RuntimeError(f"gguf_dequant_f32 failed ({status})")
    return out


def gguf_gemm_cpu(
    x: torch.Tensor, blocks: torch.Tensor, qtype: str, lib: ctypes.CDLL | None = None
) -> torch.Tensor:
    """x [M, K] @ W^T -> [M, N] in x's dtype (computed in float32), W the qtype weight in
    blocks [N, K // e, bytes]: the library's product up to MAX_ROWS rows, else W dequantised
    CHUNK_ELEMENTS at a time and torch.matmul."""
    if x.dim() != 2 or x.device.type != "cpu" or not x.is_floating_point():
        raise ValueError(f"x must be a float [M, K] CPU tensor, got {x.dtype} {list(x.shape)} on {x.device}")
    _check(blocks, qtype, x.shape[1])
    xf = x.float()
    m, n = x.shape[0], blocks.shape[0]
    if m > MAX_ROWS:
        out = matmul_in_column_chunks(
            xf, n, CHUNK_ELEMENTS, lambda cols: gguf_dequantize_cpu(blocks[cols], qtype, lib).t()
        )
    else:
        if xf.stride(1) != 1:  # (rows may be apart: the library takes x's row stride)
            xf = xf.contiguous()
        out = torch.empty(m, n, dtype=torch.float32)
        if m and n:
            status = _lib(lib).gguf_gemm_f32(TYPE_IDS[qtype], torch.get_num_threads(), xf.data_ptr(), m,
                                          x.shape[1], xf.stride(0), blocks.data_ptr(), n, out.data_ptr(), n)  # fmt: skip
            if status:
                raise RuntimeError(f"gguf_gemm_f32 failed ({status})")
    return out if x.dtype == torch.float32 else out.to(x.dtype)
