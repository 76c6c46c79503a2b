"""The w4a16 product (int4, group 128) on CUDA against a bf16 torch matmul, at Llama-3-8B's
projection shapes (N, K) and 1-256 rows: one JSON line per case, the do_bench times and the
bytes read per microsecond (packed weights and scales, symmetric: no zeros; bf16's weights).
Then, at one row, a sweep of tilings (output channels per program, words per step, programs
wanted per SM).

    python scripts/bench_wna16.py
"""

from __future__ import annotations

import functools
import itertools
import json

import torch
import triton

from mmserve.kernels._common import num_sms
from mmserve.kernels.wna16 import choose_tiling, wna16_gemm

SHAPES = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]  # qkv, o, gate_up, down


def main() -> None:
    torch.manual_seed(0)
    for n, k in SHAPES:
        qweight = torch.randint(-(2**31), 2**31 - 1, (k // 8, n), dtype=torch.int32, device="cuda")
        scales = torch.rand(k // 128, n, device="cuda", dtype=torch.bfloat16) * 0.01
        weight = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        packed_bytes = qweight.numel() * 4 + scales.numel() * 2
        for rows in (1, 4, 16, 64, 256):
            x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
            packed = functools.partial(wna16_gemm, x, qweight, scales, None, 4, 128)
            w4 = 1e3 * triton.testing.do_bench(packed, warmup=25, rep=200)
            dense = functools.partial(torch.matmul, x, weight.t())
            bf16 = 1e3 * triton.testing.do_bench(dense, warmup=25, rep=200)
            tiling = choose_tiling(rows, n, k, 128, num_sms(x.device), 4)
            print(json.dumps({"n": n, "k": k, "rows": rows, "tiling": str(tiling),
                              "w4a16_us": round(w4, 1), "w4a16_gbs": round(packed_bytes / w4 / 1e3),
                              "bf16_us": round(bf16, 1),
                              "bf16_gbs": round(weight.numel() * 2 / bf16 / 1e3)}), flush=True)  # fmt: skip
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        for block_n, words, programs in itertools.product((32, 64, 128), (16, 32), (4, 16, 32)):
            tiling = choose_tiling(1, n, k, 128, num_sms(x.device), 4, block_n, words, None, programs)
            packed = functools.partial(wna16_gemm, x, qweight, scales, None, 4, 128, tiling)
            us = 1e3 * triton.testing.do_bench(packed, warmup=25, rep=100)
            print(json.dumps({"sweep": [n, k], "tiling": [block_n, words, programs, tiling.splits],
                              "us": round(us, 1), "gbs": round(packed_bytes / us / 1e3)}), flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
