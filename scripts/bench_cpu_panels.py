"""The CPU's GGUF products with the outer-product panels (cpu_gguf.PANELS True) against the
4 x 4 tiles and, past cpu_gguf.MAX_ROWS, the dequantised weight and torch.matmul (False), the
two alternated in one process (BENCHMARKS session 45): whether a processor should take the
panels (cpu_gguf.use_panels: by the vendor today; Intel's choice was measured before the panels
multiplied each block as it is dequantised and before they took the K-quants). Random blocks
at SmolLM2-135M's shapes (its 30 layers in Q4_1, the Q8_0 head) and at a 1k-wide model's
(4 layers in Q4_K, Q5_K and Q6_K), each set of weights more than the caches hold, so that every
call streams them as a model's step does. One JSON line per type and row count: the best of
--runs, ms. Run from the repository root:

    PYTHONPATH=. python scripts/bench_cpu_panels.py [--rows 4,8,16,32,64,512] [--runs 6]
"""

from __future__ import annotations

import argparse
import json
import os
import time

os.environ.setdefault("TRITON_INTERPRET", "1")  # (tests' random_blocks import the Triton kernels' modules)

import torch

from mmserve.kernels import cpu_gguf, cpu_lib
from tests.kernels.test_gguf_gemm import random_blocks

# (label, type, [(N, K) of one layer], layers)
SETS = [
    ("smollm2-layers", "Q4_1", [(960, 576), (576, 576), (3072, 576), (576, 1536)], 30),
    ("smollm2-head", "Q8_0", [(49152, 576)], 1),
    *[
        (f"1k-{qtype}", qtype, [(1536, 1024), (1024, 1024), (5632, 1024), (1024, 2560)], 4)
        for qtype in ("Q4_K", "Q5_K", "Q6_K")
    ],
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="4,8,16,32,64,512")
    parser.add_argument("--runs", type=int, default=6)
    args = parser.parse_args()
    if not cpu_lib.available():
        raise SystemExit("the CPU library is not available here (no C compiler with OpenMP)")
    print(json.dumps({"vendor": cpu_lib.cpu_vendor(), "panels_by_default": cpu_gguf.use_panels(),
                      "threads": torch.get_num_threads()}))  # fmt: skip
    for label, qtype, shapes, layers in SETS:
        weights = [(random_blocks(qtype, n, k, i).cpu(), k) for i, (n, k) in enumerate(shapes * layers)]
        flop = 2 * layers * sum(n * k for n, k in shapes)
        for rows in (int(r) for r in args.rows.split(",")):
            xs = {k: torch.randn(rows, k) for _, k in shapes}
            best = {True: float("inf"), False: float("inf")}
            for run in range(args.runs):
                for panels in (True, False) if run % 2 else (False, True):
                    cpu_gguf.PANELS = panels
                    start = time.perf_counter()
                    for blocks, k in weights:
                        cpu_gguf.gguf_gemm_cpu(xs[k], blocks, qtype)
                    best[panels] = min(best[panels], time.perf_counter() - start)
            print(json.dumps({
                "set": label, "type": qtype, "rows": rows,
                "panels_ms": round(best[True] * 1e3, 3), "other_ms": round(best[False] * 1e3, 3),
                "panels_gflops": round(rows * flop / best[True] / 1e9, 1),
                "other_gflops": round(rows * flop / best[False] / 1e9, 1),
            }), flush=True)  # fmt: skip
    cpu_gguf.PANELS = None


if __name__ == "__main__":
    main()
