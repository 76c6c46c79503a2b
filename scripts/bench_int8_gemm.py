"""The INT8 product of many rows on CUDA, at Llama-3-8B's projection shapes (N, K) and prefill
sizes: torch._int_mm plus the scaling pass (models/int8.py's LARGE_GEMM "int_mm") against the
Triton kernel with the scales in its epilogue ("triton", mmserve/kernels/int8_gemm.py, its default
tiling and a sweep) and bf16 torch.matmul; one JSON line per case with TOP/s. Decides
LARGE_GEMM.

    python scripts/bench_int8_gemm.py
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable

import torch
import triton

from mmserve.kernels.fp8_gemm import scale_product
from mmserve.kernels.int8_gemm import Int8Tiling, int8_gemm

SHAPES = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]  # qkv, o, gate_up, down
ROWS = (256, 1024, 4096, 8192)
SWEEP = [Int8Tiling(bm, bn, bk, 8, w, s) for bm, bn, bk, w, s in itertools.product(
    (128,), (128, 256), (64, 128), (4, 8), (3, 4))]  # fmt: skip
# at 256 rows a 128 x 128 grid has too few tiles for the SMs on the narrow projections (down:
# 64 tiles on 132 SMs, 431 TOP/s against bf16's 572 in session 14): smaller tiles, more programs
SMALL_GRID = [Int8Tiling(bm, bn, 128, 8, 4, s) for bm, bn, s in ((64, 128, 4), (64, 64, 4), (128, 64, 3))]


def _tops(fn: Callable[[], object], ops: float) -> float:
    return round(ops / (triton.testing.do_bench_cudagraph(fn, rep=100) / 1e3), 1)


def _case(n: int, k: int, rows: int) -> dict:
    xq = torch.randint(-127, 128, (rows, k), dtype=torch.int8, device="cuda")
    wq = torch.randint(-127, 128, (n, k), dtype=torch.int8, device="cuda")
    xs = torch.rand(rows, 1, device="cuda") * 0.01
    ws = torch.rand(1, n, device="cuda") * 0.01
    x16, w16 = xq.bfloat16(), wq.bfloat16()
    ops = 2 * rows * n * k / 1e12
    line: dict = {"n": n, "k": k, "rows": rows,
                  "int_mm": _tops(lambda: scale_product(torch._int_mm(xq, wq.t()), xs, ws, torch.bfloat16), ops),
                  "triton": _tops(lambda: int8_gemm(xq, xs, wq, ws), ops),
                  "bf16": _tops(lambda: x16 @ w16.t(), ops)}  # fmt: skip
    if rows == 256:
        line["sweep"] = {str(t): _tops(lambda t=t: int8_gemm(xq, xs, wq, ws, tiling=t), ops) for t in SMALL_GRID}
    if rows == 4096:
        line["sweep"] = {str(t): _tops(lambda t=t: int8_gemm(xq, xs, wq, ws, tiling=t), ops) for t in SWEEP}
    return line


def main() -> None:
    torch.manual_seed(0)
    for (n, k), rows in itertools.product(SHAPES, ROWS):
        print(json.dumps(_case(n, k, rows)), flush=True)


if __name__ == "__main__":
    main()
