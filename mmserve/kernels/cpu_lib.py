"""The CPU's C library (mmserve/kernels/cpu/): GGUF products (mmserve.kernels.cpu_gguf), decode
attention over the paged KV cache (mmserve.kernels.cpu_attention) and a decoder layer's small
float32 operations (mmserve.kernels.cpu_layers). Built at first use by the
machine's C compiler for its own processor (-march=native) and cached under
MMSERVE_CACHE_DIR/cpu-kernels; its threads are torch's own OpenMP runtime (the library links
libgomp.so.1, which resolves to the one torch loaded).

Where it cannot be built (no C compiler, no OpenMP, torch not on OpenMP, MMSERVE_CPU_KERNELS=0)
or is not vectorised (x86-64 with AVX2 or AVX-512 only: the generic code was measured slower
than float32 weights) library() is None, and the callers keep their torch paths: a GGUF is
dequantised once at load, decode attention gathers its context for scaled_dot_product_attention,
RMSNorm, rotary embedding and the cache write run as torch operations.
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
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from mmserve import envs

logger = logging.getLogger(__name__)

SOURCE_DIR = Path(__file__).resolve().parent / "cpu"
EXACT_SOURCES = ("gguf_dequant", "gguf_panel", "gguf_q8", "layer_ops")  # compiled without fused multiply-adds
_I64 = ctypes.c_int64
_PTR = ctypes.c_void_p


@functools.cache
def library() -> ctypes.CDLL | None:
    """The library built for this machine, or None where it cannot be had (the reason logged
    once)."""
    if not envs.cpu_kernels_enabled():
        return None
    if "OpenMP" not in torch.__config__.parallel_info().split("parallel backend:")[-1]:
        logger.info("CPU kernels off: torch's parallel backend is not OpenMP")
        return None
    try:
        lib = load(build(envs.cache_dir() / "cpu-kernels"))
    except (OSError, subprocess.SubprocessError) as e:
        logger.warning("CPU kernels off (the torch paths run instead): %s", e)
        return None
    if not lib.gguf_cpu_vectorised():
        logger.info("CPU kernels off: no AVX2 or AVX-512 here (the generic build is slower)")
        return None
    return lib


def available() -> bool:
    return library() is not None


def load(path: Path) -> ctypes.CDLL:
    """A built library with its functions' signatures set."""
    lib = ctypes.CDLL(str(path))
    for fn in (lib.gguf_gemm_f32, lib.gguf_dequant_f32, lib.gguf_cpu_vectorised, lib.gguf_panel_supported):
        fn.restype = ctypes.c_int
    lib.gguf_panel_supported.argtypes = [ctypes.c_int]
    lib.gguf_gemm_f32.argtypes = [ctypes.c_int, ctypes.c_int, _PTR, _I64, _I64, _I64, _PTR, _I64, _PTR, _I64,
                                  ctypes.c_int]  # fmt: skip
    lib.gguf_dequant_f32.argtypes = [ctypes.c_int, ctypes.c_int, _PTR, _I64, _I64, _PTR]
    for fn in (lib.gguf_q8_supported, lib.gguf_q8_pack, lib.gguf_q8_gemm, lib.gguf_q8_quantise):
        fn.restype = ctypes.c_int
    lib.gguf_q8_supported.argtypes = [ctypes.c_int]
    lib.gguf_q8_packed_bytes.restype = _I64
    lib.gguf_q8_packed_bytes.argtypes = [ctypes.c_int, _I64, _I64]
    lib.gguf_q8_pack.argtypes = [ctypes.c_int, ctypes.c_int, _PTR, _I64, _I64, _PTR]
    lib.gguf_q8_gemm.argtypes = [ctypes.c_int, ctypes.c_int, _PTR, _I64, _I64, _I64, _PTR, _I64, _PTR, _I64]
    lib.gguf_q8_quantise.argtypes = [_PTR, _I64, _I64, _I64, _PTR, _PTR]
    for fn in (lib.rms_norm_f32, lib.rotary_f32, lib.write_kv_f32, lib.silu_and_mul_f32, lib.apply_bitmask_f32):
        fn.restype = ctypes.c_int
    lib.apply_bitmask_f32.argtypes = [ctypes.c_int, _PTR, _I64, _PTR, _I64, _PTR, _I64, _I64]
    lib.silu_and_mul_f32.argtypes = [ctypes.c_int, _PTR, _I64, _I64, _I64, _PTR]
    lib.rms_norm_f32.argtypes = [ctypes.c_int, _PTR, _I64, _PTR, _I64, _PTR, _I64, _I64, ctypes.c_float, _PTR, _PTR]
    lib.rotary_f32.argtypes = [ctypes.c_int, _PTR, _I64, _I64, _I64, _I64, _PTR, _PTR, _PTR]
    lib.write_kv_f32.argtypes = [_PTR, _I64, _PTR, _I64, _I64, _I64, _PTR, _I64, _PTR]
    lib.paged_decode_f32.restype = ctypes.c_int
    lib.paged_decode_f32.argtypes = [ctypes.c_int, _PTR, _PTR, _I64, _I64, _I64, _I64, _PTR, _I64, _PTR,
                                     _I64, _I64, ctypes.c_float, _I64, _PTR]  # fmt: skip
    return lib


def build(folder: Path, march: str = "native", flags: tuple[str, ...] = ("-O3",)) -> Path:
    """Compiles the sources for -march=`march` into folder, once per source, compiler, target,
    processor and flags (compile and link: scripts/asan_cpu_lib.py builds with sanitizers);
    concurrent builders each write their own file and rename it."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise OSError("no C compiler (cc) on PATH")
    version = subprocess.run([cc, "--version"], check=True, capture_output=True, text=True, timeout=30).stdout
    sources = sorted(SOURCE_DIR.glob("*.[ch]"))
    key = hashlib.sha256()
    for part in (version, march, platform.machine(), _cpu_flags(), *flags, *(p.read_text() for p in sources)):
        key.update(part.encode())
    target = folder / f"mmserve-{key.hexdigest()[:16]}.so"
    if target.exists():
        return target
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder) as tmp:
        commands = []
        for source in (p for p in sources if p.suffix == ".c"):
            # the dequantisation rounds as the reference does: no fused multiply-add
            contract = "off" if source.stem in EXACT_SOURCES else "fast"
            obj = Path(tmp) / f"{source.stem}.o"
            commands.append([cc, *flags, f"-march={march}", "-fPIC", "-fopenmp", f"-ffp-contract={contract}",
                             "-Wno-psabi", "-c", str(source), "-o", str(obj)])  # fmt: skip
        # the sources at once, one compiler a core (gguf_panel.c alone takes about 12 s)
        with ThreadPoolExecutor(max_workers=max(1, min(len(commands), os.cpu_count() or 1))) as pool:
            list(pool.map(_compile, commands))
        objects = [command[-1] for command in commands]
        built = Path(tmp) / "lib.so"
        _compile([cc, "-shared", *flags, "-fopenmp", *objects, "-o", str(built)])
        os.replace(built, target)
    return target


def _compile(command: list[str]) -> None:
    done = subprocess.run(command, check=False, capture_output=True, text=True, timeout=300)
    if done.returncode:
        raise OSError(f"{Path(command[0]).name} failed: {done.stderr.strip()[-500:]}")


def _cpu_flags() -> str:
    """The processor's feature flags (-march=native builds for them), where Linux lists them."""
    return _cpuinfo_line(("flags", "Features")) or platform.processor()


def cpu_vendor() -> str:
    """The processor's vendor as Linux names it (GenuineIntel, AuthenticAMD, ...), else ""."""
    line = _cpuinfo_line(("vendor_id",))
    return line.partition(":")[2].strip()


def _cpuinfo_line(keys: tuple[str, ...]) -> str:
    """/proc/cpuinfo's first line starting with one of keys ("" where there is none)."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""
    return next((line for line in info.splitlines() if line.startswith(keys)), "")


def require(lib: ctypes.CDLL | None = None) -> ctypes.CDLL:
    """lib, else this machine's library; raises where there is none."""
    lib = lib or library()
    if lib is None:
        raise RuntimeError("the CPU kernels are not available on this machine")
    return lib
