"""The GGUF few-rows kernel's main loop in sm_90 SASS, counted on any machine (no GPU): Triton
compiles it for sm_90 (tests/kernels/sm90_compile.py), cuobjdump (shipped with Triton)
disassembles it, and the longest loop's instructions are counted per weight and thread (a
program's step covers BLOCK_N x 256 weights over num_warps x 32 threads), with an
instruction-mix histogram. A proxy for the kernel's issue time, not a timing: bench_gguf.py
times the kernels on a GPU.

    env -u TRITON_INTERPRET python scripts/sass_loop.py [QTYPE ...]  (w4a16: wna16's DP4A kernel;
    fp8: the FP8 / INT8 rows kernel by row tile)
"""

from __future__ import annotations

import collections
import itertools
import re
import subprocess
import sys
from pathlib import Path

import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from mmserve.kernels import fp8_gemm, gguf_gemm, wna16
from mmserve.kernels.gguf_blocks import FORMATS, LOWP_TYPES, STEP_PARTS
from tests.kernels.sm90_compile import (
    DP4A,
    FP8,
    Q6K_DP4A,
    ROWS,
    WNA16_DP4A,
    WNA16_DP4A_ROWS,
    compile_sm90,
)

CUOBJDUMP = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
ALIGNED = ("row_bytes", "stride_x", "n")


def loop_body(cubin: bytes, tmp: Path) -> list[str]:
    """The instructions of the longest backward-branching loop."""
    tmp.write_bytes(cubin)
    sass = subprocess.run([str(CUOBJDUMP), "-sass", str(tmp)], check=True, capture_output=True, text=True).stdout
    code = [(int(m[1], 16), m[2]) for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;", sass)]
    loops = []
    for addr, text in code:
        branch = re.search(r"BRA (0x[0-9a-f]+)", text)
        if branch and int(branch[1], 16) < addr:
            loops.append([t for a, t in code if int(branch[1], 16) <= a <= addr])
    return max(loops, key=len) if loops else []


def _print_loop(name: str, kernel: object, tmp: Path, weights: float) -> None:
    body = loop_body(kernel.asm["cubin"], tmp)  # type: ignore[attr-defined]
    ops = collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", t).split()[0].split(".")[0] for t in body)
    mix = " ".join(f"{op}:{count}" for op, count in ops.most_common(12))
    print(f"{name}: {len(body)} instructions a step, {len(body) / weights:.2f} a weight; {mix}", flush=True)


def main(qtypes: list[str]) -> None:
    tmp = Path("/tmp/mmserve_sass_loop.cubin")
    if "fp8" in qtypes:  # the rows kernel's step of 64 channels: FP8 by row tile (16 / 32: mma, 64: wgmma), INT8
        for int8, block_m, block_k in ((False, 16, 512), (False, 32, 512), (False, 64, 256), (True, 16, 512)):
            types = {"part_ptr": "*i32", "xq_ptr": "*i8", "wq_ptr": "*i8"} if int8 else {}
            constexprs = {"BLOCK_M": block_m, "BLOCK_N": 64, "BLOCK_K": block_k, "INT8": int8, "PROMOTE": 128,
                          "SPLIT": True, "SERIAL": True, "PREFETCH_LINES": 0, "ASM": True}  # fmt: skip
            aligned = ("n", "k", "k_per_split", "stride_x", "stride_w", "stride_out")
            kernel = compile_sm90(fp8_gemm._fp8_gemm_rows_kernel, {**FP8, **types}, constexprs, aligned)
            _print_loop(f"{'int8' if int8 else 'fp8'} rows block_m={block_m} block_k={block_k}", kernel, tmp,
                        64 * block_k / 128)  # fmt: skip
        qtypes = [q for q in qtypes if q != "fp8"]
    if "w4a16" in qtypes:  # wna16's one-row int8-activation product: 128 values of K a step
        for block_n, warps in ((64, 4), (128, 4), (64, 1), (128, 1)):
            constexprs = {"BLOCK_N": block_n, "HAS_ZEROS": False, "SPLIT": True, "ASM": True, "SERIAL": False, "PREFETCH": 0}
            kernel = compile_sm90(wna16._wna16_dp4a_kernel, WNA16_DP4A, constexprs, ("n", "stride_q", "stride_s"), warps)
            _print_loop(f"w4a16 dp4a block_n={block_n} warps={warps}", kernel, tmp, block_n * 128 / (warps * 32))
        for rows, warps in itertools.product((2, 4, 8), (4, 1)):  # several rows, their activations quantised first
            constexprs = {"BLOCK_N": 128, "HAS_ZEROS": False, "SPLIT": True, "ASM": True, "SERIAL": False, "ROWS": rows}
            kernel = compile_sm90(wna16._wna16_dp4a_rows_kernel, WNA16_DP4A_ROWS, constexprs, ("n", "stride_q", "stride_s"), warps)
            name = f"w4a16 dp4a rows={rows} block_n=128 warps={warps} (a weight: all rows)"
            _print_loop(name, kernel, tmp, 128 * 128 / (warps * 32))
        qtypes = [q for q in qtypes if q != "w4a16"]
    for qtype in qtypes:
        fmt = FORMATS[qtype]
        forms = [("dequant_tiles", {})]
        if qtype in ("Q4_K", "Q5_K"):
            forms.append(("factored", {"FACTORED": True}))
        if qtype in LOWP_TYPES:
            forms.append(("lowp", {"LOWP": True, "ASM": True}))
        if qtype in ("Q4_K", "Q5_K"):
            forms.append(("lowp_words", {"LOWP": True, "ASM": True, "WORDS": True}))
        if qtype == "Q6_K":  # the weight in planes (gguf_planes, gguf_gemm.Q6K_ALIGNED)
            forms.append(("lowp_planes", {"LOWP": True, "ASM": True, "PLANES": True}))
        for (name, form), (block_n, warps) in ((f, t) for f in forms for t in ((64, 4), (128, 4))):
            constexprs = {**fmt.kernel_args(), "PARTS": STEP_PARTS[fmt.type_id], "IEEE": False,
                          "BLOCK_M": 16, "BLOCK_N": block_n, "SPLIT": True, "FACTORED": False,
                          "UNROLL": 1, "LOWP": False, "ASM": False, "WORDS": False, "SERIAL": False,
                          "PLANES": False, **form}  # fmt: skip
            kernel = compile_sm90(gguf_gemm._gguf_gemm_rows_kernel, ROWS, constexprs, ALIGNED, warps)
            _print_loop(f"{qtype} {name} block_n={block_n} warps={warps}", kernel, tmp, block_n * 256 / (warps * 32))
        dp4a = ((b, w, p) for b, w in ((64, 4), (128, 4), (256, 8)) for p in (False, True))
        for block_n, warps, pre in dp4a if qtype in gguf_gemm.DP4A_KERNEL_TYPES else ():
            if qtype == "Q6_K":  # its activations always quantised first; pre here: the weight in planes
                constexprs = {"BLOCK_N": block_n, "ROWS": 1, "SPLIT": True, "ASM": True, "SERIAL": False, "PLANES": pre}
                fn, signature = gguf_gemm._gguf_q6k_dp4a_kernel, Q6K_DP4A
            else:
                constexprs = {"QTYPE": fmt.type_id, "BYTES": fmt.bytes, "BLOCK_N": block_n, "ROWS": 1, "SPLIT": True,
                              "ASM": True, "PREQUANT": pre, "SERIAL": False}  # fmt: skip
                fn, signature = gguf_gemm._gguf_dp4a_kernel, {**DP4A, "x_ptr": "*i32" if pre else "*bf16"}
            aligned = tuple(a for a in ("row_bytes", "n", "stride_x") if a in signature)
            kernel = compile_sm90(fn, signature, constexprs, aligned, warps)
            name = f"{qtype} dp4a{'_prequant' if pre else ''} block_n={block_n} warps={warps}"
            if qtype == "Q6_K":
                name = f"{qtype} dp4a{'_planes' if pre else ''} block_n={block_n} warps={warps}"
            _print_loop(name, kernel, tmp, block_n * 256 / (warps * 32))
        several = itertools.product((2, 4, 8), (64, 128), (False, True)) if qtype in gguf_gemm.DP4A_TYPES else ()
        for rows, block_n, pre in several:  # a tile's quants unpacked once for all rows
            constexprs = {"QTYPE": fmt.type_id, "BYTES": fmt.bytes, "BLOCK_N": block_n, "ROWS": rows, "SPLIT": True,
                          "ASM": True, "PREQUANT": pre, "SERIAL": False}  # fmt: skip
            signature = {**DP4A, "x_ptr": "*i32" if pre else "*bf16"}
            kernel = compile_sm90(gguf_gemm._gguf_dp4a_kernel, signature, constexprs, ("row_bytes", "n", "stride_x"), 4)
            name = f"{qtype} dp4a{'_prequant' if pre else ''} rows={rows} block_n={block_n} warps=4 (a weight: all rows)"
            _print_loop(name, kernel, tmp, block_n * 256 / 128)
        several_q6k = itertools.product((2, 4), (64, 128), (False, True)) if qtype == "Q6_K" else ()
        for rows, block_n, planes in several_q6k:  # (gguf_gemm.Q6K_ALIGNED: planes up to DP4A_MAX_ROWS rows)
            constexprs = {"BLOCK_N": block_n, "ROWS": rows, "SPLIT": True, "ASM": True, "SERIAL": False, "PLANES": planes}
            kernel = compile_sm90(gguf_gemm._gguf_q6k_dp4a_kernel, Q6K_DP4A, constexprs, ("row_bytes", "n"), 4)
            name = f"{qtype} dp4a{'_planes' if planes else ''} rows={rows} block_n={block_n} warps=4 (a weight: all rows)"
            _print_loop(name, kernel, tmp, block_n * 256 / 128)


if __name__ == "__main__":
    main(sys.argv[1:] or ["Q4_K", "Q6_K"])
