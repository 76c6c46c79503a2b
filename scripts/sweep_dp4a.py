"""w4a16's one-row int8-activation product (wna16.DP4A) over its launch knobs, on a GPU (issue 19):
programs per SM (the K split), warps a program, pipeline depth and channels a program, at the 8B
shape's projections (g128, symmetric as the bench's w4a16-g128), bf16. Prints, per shape, the
default's microseconds and read bandwidth, each setting's, the best, and a same-run copy of the
weight's bytes (device to device, counted read + write) as the bandwidth the card gives. Times
are CUDA graphs over 8 copies of the weight (past the L2).

    python scripts/sweep_dp4a.py [--quick] [--rows R] [--config KNOB=V,KNOB=V ...]

--rows 2-4 times the several-row kernel instead (its knobs DP4A_ROWS_NUM_WARPS, PROGRAMS_PER_SM,
DP4A_BLOCK_N; sm_90 SASS of its loop at 2 / 4 rows: 4.55 / 7.98 instructions a weight at 4 warps,
2.26 / 3.72 at one, session 28, not yet timed).

--config DP4A_FUSED_ONE_ROW=0,... times one row on the several-row kernel, its activations quantised
first by a launch of their own (counted in its time).

--config times the listed settings instead of a grid (each KNOB one of KNOBS, the rest the
default's), for instance channels a program tied to its warps (BLOCK_N = 128 x warps: every
thread owns all 16 words of a step for its four channels, so a group's sums stay in the thread;
sm_90 SASS of the loop, scripts/sass_loop.py: 1.54 instructions a weight at 512 channels and 4
warps against 3.13 at the default's 128 and 4, and 32 KB a program a step in flight, not 8).
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch
import triton

from mmserve.kernels import wna16
from mmserve.kernels.wna16 import pack_columns, wna16_gemm, wna16_gemm_ref

SHAPES = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]  # (N, K)
KNOBS = ("DP4A_PROGRAMS_PER_SM", "DP4A_NUM_WARPS", "DP4A_NUM_STAGES", "DP4A_BLOCK_N", "DP4A_PREFETCH_STEPS",
         "DP4A_ROWS_NUM_WARPS", "PROGRAMS_PER_SM", "DP4A_FUSED_ONE_ROW", "DP4A_NARROW")
# (DP4A_ROWS_NUM_WARPS and PROGRAMS_PER_SM: the several-row kernel's, --rows, or one row's with
# DP4A_FUSED_ONE_ROW=0)
GRID = {
    "DP4A_PROGRAMS_PER_SM": (2, 4, 8, 16),
    "DP4A_NUM_WARPS": (1, 2, 4),
    "DP4A_NUM_STAGES": (None, 1, 4),
    "DP4A_BLOCK_N": (128, 256),
    "DP4A_PREFETCH_STEPS": (0, 1, 2, 4),
}
QUICK = {"DP4A_PROGRAMS_PER_SM": (4, 8), "DP4A_NUM_WARPS": (1, 4), "DP4A_NUM_STAGES": (None,), "DP4A_BLOCK_N": (128,),
         "DP4A_PREFETCH_STEPS": (0, 2)}  # fmt: skip


def _parse(config: str) -> dict[str, int | None]:
    """"DP4A_BLOCK_N=512,DP4A_NUM_WARPS=4" -> {knob: value} (None for "None")."""
    pairs = [item.split("=", 1) for item in config.split(",") if item]
    unknown = [name for name, _ in pairs if name not in KNOBS]
    if unknown:
        raise SystemExit(f"unknown knobs {unknown}: one of {KNOBS}")
    return {name: None if value == "None" else int(value) for name, value in pairs}


def timed(fn, copies: int) -> float:  # type: ignore[no-untyped-def]
    return 1e3 * triton.testing.do_bench_cudagraph(fn, rep=60) / copies  # microseconds a product


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--config", action="append", default=[], help="KNOB=V,KNOB=V (repeatable)")
    parser.add_argument("--rows", type=int, default=1, help="rows of x (2-4: the several-row kernel)")
    args = parser.parse_args()
    torch.manual_seed(0)
    default = {name: getattr(wna16, name) for name in KNOBS}
    settings = [tuple({**default, **_parse(c)}[name] for name in KNOBS) for c in args.config]
    if not settings:  # a grid over its knobs, the others the default's
        grid = {name: (default[name],) for name in KNOBS} | (QUICK if args.quick else GRID)
        settings = list(itertools.product(*(grid[name] for name in KNOBS)))
    copies = 8
    for n, k in SHAPES:
        qs = [pack_columns(torch.randint(0, 16, (k, n)), 4).cuda() for _ in range(copies)]
        scales = (torch.rand(k // 128, n) * 0.02 + 0.001).to(torch.bfloat16).cuda()
        x = torch.randn(args.rows, k, device="cuda", dtype=torch.bfloat16)
        # the reference on the CPU: on H100s torch's float32 reference of gate_up and down on the
        # GPU came out non-finite (26,917 of 28,672 and 4,095 of 4,096 outputs, sessions 27-28),
        # while the kernel's outputs were finite and the same reference on the CPU is too
        exact = wna16_gemm_ref(x.cpu(), qs[0].cpu(), scales.cpu(), None, 4, 128).cuda()
        nbytes = qs[0].numel() * 4 + scales.numel() * 2
        sinks = [torch.empty_like(q) for q in qs]

        def copy(qs=qs, sinks=sinks) -> None:  # type: ignore[no-untyped-def]
            for q, sink in zip(qs, sinks, strict=True):
                sink.copy_(q)

        copy_gbps = 2 * qs[0].numel() * 4 / timed(copy, copies) / 1e3

        def run(x=x, qs=qs, scales=scales) -> None:  # type: ignore[no-untyped-def]
            for q in qs:
                wna16_gemm(x, q, scales, None, 4, 128, dp4a=True)

        results = []
        for values in settings:
            for name, value in zip(KNOBS, values, strict=True):
                setattr(wna16, name, value)
            try:
                out = wna16_gemm(x, qs[0], scales, None, 4, 128, dp4a=True).float()
                err = ((out - exact).norm() / exact.norm()).item()
                bad = int((~torch.isfinite(out)).sum().item())  # (session 27 saw NaN errors)
                us = timed(run, copies)
            except (RuntimeError, triton.runtime.errors.OutOfResources) as exc:  # (past the card's resources)
                print(json.dumps({"n": n, "k": k, **dict(zip(KNOBS, values, strict=True)), "error": str(exc)[:120]}))
                continue
            finally:
                for name, value in default.items():
                    setattr(wna16, name, value)
            line = {**dict(zip(KNOBS, values, strict=True)), "us": round(us, 2),
                    "GBps": round(nbytes / us / 1e3), "rel_err": round(err, 5), "nonfinite": bad,
                    "ref_nonfinite": int((~torch.isfinite(exact)).sum().item())}  # fmt: skip
            results.append(line)
            print(json.dumps({"n": n, "k": k, **line}), flush=True)
        base = next((r for r in results if all(r[name] == default[name] for name in KNOBS)), None)
        best = min(results, key=lambda r: r["us"]) if results else None
        print(json.dumps({"n": n, "k": k, "MB": round(nbytes / 1e6, 1), "copy_GBps": round(copy_gbps),
                          "default": base, "best": best}), flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
