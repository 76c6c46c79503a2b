"""FP8 products on Llama-3-8B's projection shapes, on the GPU: bf16 (cuBLAS), torch._scaled_mm
with row-wise scales (also with fast accumulation, and on rows padded to a multiple of 128),
mmserve/kernels/fp8_gemm.py up to 32 rows (its default blocks, K split in 2, 4 and 8, or --sweep over
block sizes), plus the per-token quantisation kernel. One JSON line per (rows, projection); times in
microseconds per product over back-to-back launches replayed from a CUDA graph.

    python scripts/fp8_kernels.py [--rows 1,16,32,256,4096] [--sweep]

(The session-6 figures in BENCHMARKS.md came from the same measurements in ad-hoc scripts.)
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from collections.abc import Callable

import torch

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
BANDWIDTH = 4.18e12  # bytes/s, the H200's measured copy rate (BENCHMARKS.md)


def time_us(fn: Callable[[], object], iters: int = 50) -> float:
    for _ in range(3):
        fn()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(iters):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters * 1e3


def measure(rows: int, name: str, n: int, k: int, sweep: bool) -> dict[str, object]:
    """One JSON line: the products of `rows` rows by the [n, k] projection, every way."""
    from mmserve.kernels.fp8_gemm import MAX_ROWS, fp8_gemm_rows
    from mmserve.kernels.quant import per_token_quant_fp8, quantize_weight_fp8

    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
    wq, ws = quantize_weight_fp8(w)
    ws = ws.view(1, -1)
    xq, xs = per_token_quant_fp8(x)
    line: dict[str, object] = {"rows": rows, "product": name, "n": n, "k": k}
    line["fp8_weight_floor_us"] = n * k / BANDWIDTH * 1e6
    bf16 = line["bf16_us"] = time_us(lambda: x @ w.t())
    scaled = line["scaled_mm_us"] = time_us(
        lambda: torch._scaled_mm(xq, wq.t(), scale_a=xs, scale_b=ws, out_dtype=torch.bfloat16)
    )
    line["quant_us"] = time_us(lambda: per_token_quant_fp8(x))
    if rows > MAX_ROWS:  # torch._scaled_mm's choices (models/fp8.py PAD_ROWS), at odd row counts too
        line["scaled_mm_fast_accum_us"] = time_us(
            lambda: torch._scaled_mm(xq, wq.t(), scale_a=xs, scale_b=ws, out_dtype=torch.bfloat16, use_fast_accum=True)
        )
        padded = -(-rows // 128) * 128
        xp, sp = torch.zeros(padded, k, device="cuda", dtype=xq.dtype), torch.ones(padded, 1, device="cuda")

        def pad_and_multiply() -> torch.Tensor:  # (the copy in and the slice out counted)
            xp[:rows].copy_(xq)
            sp[:rows].copy_(xs)
            return torch._scaled_mm(xp, wq.t(), scale_a=sp, scale_b=ws, out_dtype=torch.bfloat16)[:rows]

        line["scaled_mm_padded_us"] = time_us(pad_and_multiply)
    if rows <= MAX_ROWS:
        line["ours_us"] = time_us(lambda: fp8_gemm_rows(xq, xs, wq, ws))
        for splits in (2, 4, 8):  # K split (mmserve/kernels/fp8_gemm.py SPLIT_BELOW decides from these)
            line[f"ours_split{splits}_us"] = time_us(functools.partial(fp8_gemm_rows, xq, xs, wq, ws, splits=splits))
        for bn, bk in (
            [(bn, bk) for bn in (16, 32, 64, 128) for bk in (128, 256, 512)] if sweep else []
        ):
            try:  # a pair whose tiles overflow shared memory fails to launch: say so, go on
                line[f"ours_n{bn}_k{bk}_us"] = time_us(
                    functools.partial(fp8_gemm_rows, xq, xs, wq, ws, block_n=bn, block_k=bk)
                )
            except RuntimeError as e:
                line[f"ours_n{bn}_k{bk}_us"] = str(e)[:80]
    line["bf16_tflops"] = 2 * rows * n * k / bf16 / 1e6
    line["scaled_mm_tflops"] = 2 * rows * n * k / scaled / 1e6
    return line


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,16,32,256,512,518,1024,1030,4096,16384")
    parser.add_argument(
        "--sweep", action="store_true", help="also every block size of the few-rows kernel"
    )
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    for rows in (int(r) for r in args.rows.split(",")):
        for name, (n, k) in SHAPES.items():
            print(json.dumps(measure(rows, name, n, k, args.sweep)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
