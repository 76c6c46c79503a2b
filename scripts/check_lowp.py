"""LOWP on a GPU, quickly (issue 19): w4a16's 16-bit form against its float32 form and the
dequantised weight's product at the 8B shape's projections, bf16, 1 and 16 rows; relative
errors and microseconds (CUDA graphs, weights cycled past the L2). At one row also the
int8-activation form (wna16.DP4A), against the exact product and its own reference, and timed
at 64 and 256 channels a program too; at 2, 4 and 8 rows LOWP against the int8-activation rows
kernel. The GGUF forms are scripts/bench_gguf.py's.

    python scripts/check_lowp.py
"""

from __future__ import annotations

import json

import torch
import triton

from mmserve.kernels import wna16
from mmserve.kernels.wna16 import (
    choose_tiling,
    dequantize_packed,
    pack_columns,
    wna16_dp4a_ref,
    wna16_gemm,
    wna16_gemm_ref,
)

SHAPES = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]  # (N, K)


def main() -> None:
    torch.manual_seed(0)
    for n, k in SHAPES:
        copies = 8
        qs = [pack_columns(torch.randint(0, 16, (k, n)), 4).cuda() for _ in range(copies)]
        scales = (torch.rand(k // 128, n) * 0.02 + 0.001).to(torch.bfloat16).cuda()
        zeros = torch.randint(0, 16, (k // 128, n)).to(torch.bfloat16).cuda()
        weight = dequantize_packed(qs[0].cpu(), scales.cpu(), zeros.cpu(), 4, 128).float().cuda()
        for rows in (1, 16):
            x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
            ref = x.float() @ weight.t()
            line: dict[str, object] = {"n": n, "k": k, "rows": rows}
            for lowp in (False, True):
                tiling = choose_tiling(rows, n, k, 128, torch.cuda.get_device_properties(0).multi_processor_count,
                                       lowp=lowp)  # fmt: skip
                out = wna16_gemm(x, qs[0], scales, zeros, 4, 128, tiling).float()
                key = "lowp" if lowp else "float32"
                line[f"{key}_rel_err"] = round(((out - ref).norm() / ref.norm()).item(), 6)

                def run(tiling=tiling, x=x, qs=qs, scales=scales, zeros=zeros) -> None:  # type: ignore[no-untyped-def]
                    for q in qs:
                        wna16_gemm(x, q, scales, zeros, 4, 128, tiling)

                line[f"{key}_us"] = round(1e3 * triton.testing.do_bench_cudagraph(run, rep=100) / copies, 1)
            if rows == 1:  # int8 activations (dp4a), asymmetric and symmetric
                for z in (zeros, None):
                    key = "dp4a" if z is not None else "dp4a_symmetric"
                    out = wna16_gemm(x, qs[0], scales, z, 4, 128, dp4a=True).float()
                    exact = wna16_gemm_ref(x, qs[0], scales, z, 4, 128)
                    own = wna16_dp4a_ref(x, qs[0], scales, z, 4, 128)
                    line[f"{key}_rel_err"] = round(((out - exact).norm() / exact.norm()).item(), 6)
                    line[f"{key}_max_err_to_its_ref"] = round(((out - own).abs().max() / own.abs().max()).item(), 6)

                    def run_dp4a(x=x, qs=qs, scales=scales, z=z) -> None:  # type: ignore[no-untyped-def]
                        for q in qs:
                            wna16_gemm(x, q, scales, z, 4, 128, dp4a=True)

                    line[f"{key}_us"] = round(1e3 * triton.testing.do_bench_cudagraph(run_dp4a, rep=100) / copies, 1)
                default = wna16.DP4A_BLOCK_N
                for block_n in (64, 256):  # output channels a program (the default: DP4A_BLOCK_N)
                    wna16.DP4A_BLOCK_N = block_n
                    try:
                        us = triton.testing.do_bench_cudagraph(run_dp4a, rep=100)  # (z: the symmetric weight's)
                    finally:
                        wna16.DP4A_BLOCK_N = default
                    line[f"dp4a_symmetric_{block_n}ch_us"] = round(1e3 * us / copies, 1)
            print(json.dumps(line), flush=True)
        for rows in (2, 4, 8):  # several rows: LOWP (the default) against the int8-activation rows kernel
            x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
            line = {"n": n, "k": k, "rows": rows}
            for key, dp4a in (("lowp", False), ("dp4a", True)):
                out = wna16_gemm(x, qs[0], scales, zeros, 4, 128, dp4a=dp4a).float()
                exact = wna16_gemm_ref(x, qs[0], scales, zeros, 4, 128)
                line[f"{key}_rel_err"] = round(((out - exact).norm() / exact.norm()).item(), 6)

                def run_rows(x=x, qs=qs, scales=scales, zeros=zeros, dp4a=dp4a) -> None:  # type: ignore[no-untyped-def]
                    for q in qs:
                        wna16_gemm(x, q, scales, zeros, 4, 128, dp4a=dp4a)

                line[f"{key}_us"] = round(1e3 * triton.testing.do_bench_cudagraph(run_rows, rep=100) / copies, 1)
            print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
