"""The w4a16 product (int4, group 128) on CUDA against a bf16 torch matmul, at Llama-3-8B's
projection shapes (N, K) and 1-256 rows: one JSON line per case, the times in CUDA graphs
(do_bench_cudagraph: the kernels alone, as a decode step runs them; plain do_bench also timed
the Python launch, ~100 us), each product cycling through enough copies of its weights to
overflow the L2 cache, and the bytes read per microsecond (packed weights and scales,
symmetric: no zeros; bf16's weights). Then a sweep at 1 and 16 rows of the product's two
forms (the weight dequantised in float32 per value; "lowp": in bf16, two values at a time) by
output channels per program and programs wanted per SM: it decides wna16.LOWP.

    python scripts/bench_wna16.py
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable

import torch
import triton

from mmserve.kernels._common import num_sms
from mmserve.kernels.wna16 import Wna16Tiling, choose_tiling, wna16_gemm

SHAPES = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]  # qkv, o, gate_up, down
L2_OVERFLOW = 160e6  # bytes of weights cycled through per timed call (the H200's L2: 50 MB)


def _time(product: Callable[[int], object], copies: int) -> float:
    """us per product, in a CUDA graph, over `copies` weights in turn."""

    def run() -> None:
        for i in range(copies):
            product(i)

    return 1e3 * triton.testing.do_bench_cudagraph(run, rep=100) / copies


def _shape(n: int, k: int) -> None:
    packed_bytes = (k // 8) * n * 4 + (k // 128) * n * 2
    copies = max(2, int(L2_OVERFLOW // packed_bytes) + 1)
    dense_copies = max(2, int(L2_OVERFLOW // (n * k * 2)) + 1)
    qweights = [torch.randint(-(2**31), 2**31 - 1, (k // 8, n), dtype=torch.int32, device="cuda") for _ in range(copies)]
    scales = torch.rand(k // 128, n, device="cuda", dtype=torch.bfloat16) * 0.01
    weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(dense_copies)]

    def packed(x: torch.Tensor, tiling: Wna16Tiling | None = None) -> Callable[[int], object]:
        return lambda i: wna16_gemm(x, qweights[i], scales, None, 4, 128, tiling)

    for rows in (1, 2, 4, 16, 64, 256):
        x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
        w4 = _time(packed(x), copies)
        bf16 = _time(lambda i, x=x: torch.matmul(x, weights[i].t()), dense_copies)
        tiling = choose_tiling(rows, n, k, 128, num_sms(x.device), 4)
        print(json.dumps({"n": n, "k": k, "rows": rows, "tiling": str(tiling),
                          "w4a16_us": round(w4, 1), "w4a16_gbs": round(packed_bytes / w4 / 1e3),
                          "bf16_us": round(bf16, 1), "bf16_gbs": round(n * k * 2 / bf16 / 1e3)}), flush=True)  # fmt: skip
    for rows in (1, 16):
        x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
        for lowp, block_n, programs in itertools.product((False, True), (64, 128), (4, 16)):
            tiling = choose_tiling(rows, n, k, 128, num_sms(x.device), 4, block_n, 16, None, programs, lowp=lowp)
            us = _time(packed(x, tiling), copies)
            print(json.dumps({"sweep": [n, k, rows], "lowp": lowp, "tiling": [block_n, programs, tiling.splits],
                              "us": round(us, 1), "gbs": round(packed_bytes / us / 1e3)}), flush=True)  # fmt: skip


def main() -> None:
    torch.manual_seed(0)
    for n, k in SHAPES:
        _shape(n, k)


if __name__ == "__main__":
    main()
