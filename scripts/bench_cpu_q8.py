"""The CPU's GGUF products alone, float32 (cpu_gguf.gguf_gemm_cpu, the default) against int8
activations (cpu_gguf.q8_gemm, --cpu-gguf-activations int8), BENCHMARKS session 39: random
blocks quantised by the gguf package at SmolLM2-135M's shapes (Q4_1 layers x 30, the Q8_0
head), and random K-quant blocks at Llama-3.2-1B's shapes; one product timed in a loop, so
each weight stays in the caches (a model's step streams them: see BENCHMARKS). Run from the
repository root:

    PYTHONPATH=. python scripts/bench_cpu_q8.py [--rows 1,16,256,2048]
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable

os.environ.setdefault("TRITON_INTERPRET", "1")  # (tests' random_blocks import the Triton kernels' modules)

import torch

from mmserve.kernels import cpu_gguf
from mmserve.kernels.gguf_blocks import FORMATS
from tests.kernels.test_gguf_gemm import random_blocks

# name, N, K, type, how many a step (SmolLM2: 30 layers, the tied head once)
SMOLLM2 = [("qkv", 960, 576, "Q4_1", 30), ("o", 576, 576, "Q4_1", 30), ("gate_up", 3072, 576, "Q4_1", 30),
           ("down", 576, 1536, "Q4_1", 30), ("head", 49152, 576, "Q8_0", 1)]  # fmt: skip
K_QUANTS = [("Q4_K", 2048, 2048), ("Q4_K", 16384, 2048), ("Q5_K", 2048, 2048), ("Q6_K", 2048, 8192)]


def _ms(fn: Callable[[], object], reps: int) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - start) / reps * 1e3


def _pair(blocks: torch.Tensor, qtype: str, rows: int) -> tuple[float, float]:
    n, k = blocks.shape[0], blocks.shape[1] * FORMATS[qtype].elements
    packed, x = cpu_gguf.q8_pack(blocks, qtype), torch.randn(rows, k)
    reps = 30 if rows <= 16 else 5 if rows <= 256 else 2
    exact = _ms(lambda: cpu_gguf.gguf_gemm_cpu(x, blocks, qtype), reps)
    int8 = _ms(lambda: cpu_gguf.q8_gemm(x, packed, FORMATS[qtype].type_id, n), reps)
    return exact, int8


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="1,16,256,2048")
    args = parser.parse_args()
    if not cpu_gguf.q8_supported("Q4_1"):
        raise SystemExit("no int8-activation product here (the CPU library with AVX-512 VNNI)")
    rows = [int(r) for r in args.rows.split(",")]
    smollm2 = [(name, random_blocks(qtype, n, k, seed=0).cpu(), qtype, times) for name, n, k, qtype, times in SMOLLM2]
    for m in rows:
        total_exact = total_int8 = 0.0
        for name, blocks, qtype, times in smollm2:
            if name == "head" and m > 16:
                continue  # (a prefill computes the head at its last rows only)
            exact, int8 = _pair(blocks, qtype, m)
            total_exact, total_int8 = total_exact + times * exact, total_int8 + times * int8
            print(f"SmolLM2 {name} {m} rows: float32 {exact:.3f} ms, int8 {int8:.3f} ms ({exact / int8:.2f}x)")
        print(f"SmolLM2, a step's products at {m} rows: float32 {total_exact:.1f} ms, int8 {total_int8:.1f} ms")
    for qtype, n, k in K_QUANTS:
        blocks = random_blocks(qtype, n, k, seed=0).cpu()
        for m in (r for r in rows if r <= 256):
            exact, int8 = _pair(blocks, qtype, m)
            print(f"{qtype} {n} x {k}, {m} rows: float32 {exact:.2f} ms, int8 {int8:.2f} ms ({exact / int8:.1f}x)")


if __name__ == "__main__":
    main()
