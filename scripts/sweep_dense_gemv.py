"""One-row bf16 products of the 8B shape's projections (issue 23, target 1): our Triton kernel
(mmserve.kernels.dense_gemv) over a sweep of tilings against cuBLAS's F.linear, in the harness of
scripts/bench_splitk_gemv.py (16 copies of each weight in turn, so L2 does not hold them; CUDA
graphs of 16 products; us a product). Prints one JSON line a shape with F.linear's time, the
best tilings and their error against float32, then a line with the tiling best over all shapes.
--near: the tilings around session 40's best, and the LM head; --fp8: FP8 operands, scaled_gemv
against fp8_gemm_rows; --rows 2,4,8: a few rows against F.linear.

  python3 scripts/sweep_dense_gemv.py [--quick | --near | --fp8 | --rows 2,4,8]"""

from __future__ import annotations

import argparse
import itertools
import json

import torch
import torch.nn.functional as F
from bench_splitk_gemv import COPIES, SHAPES, timed  # (this folder: the same harness and shapes)

from mmserve.kernels.dense_gemv import GemvTiling, dense_gemv, scaled_gemv
from mmserve.kernels.fp8_gemm import fp8_gemm_rows
from mmserve.kernels.quant import per_token_quant_ref, quantize_weight_fp8


def tilings(quick: bool, near: bool = False, fp8: bool = False) -> list[GemvTiling]:
    if fp8:  # one-byte weights: wider steps
        grid = itertools.product((1, 2, 4), (1024, 2048, 4096, 8192), (4, 8), (None,), (8,))
        return [GemvTiling(*t) for t in grid if 8 <= t[0] * t[1] // (32 * t[2]) <= 128]
    if near:  # around session 40's best (2 channels, 1,024 weights a step, 4 warps)
        grid = itertools.product((1, 2, 4), (512, 1024, 2048, 4096), (2, 4, 8), (None,), (4, 8))
        return [GemvTiling(*t) for t in grid if 8 <= t[0] * t[1] // (32 * t[2]) <= 64]
    out = []
    warps = (1, 2, 4) if quick else (1, 2, 4, 8)
    for bn, bk, w, st, pps in itertools.product((2, 4, 8, 16, 32), (128, 256, 512, 1024), warps, (None, 2, 4), (4, 8, 16)):
        per_thread = bn * bk // (32 * w)
        if not 8 <= per_thread <= 64:
            continue
        if quick and (st == 4 or pps == 16):
            continue
        out.append(GemvTiling(bn, bk, w, st, pps))
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true")
    p.add_argument("--near", action="store_true", help="around the best tiling found, and the LM head")
    p.add_argument("--fp8", action="store_true", help="FP8 weights and activations: scaled_gemv against fp8_gemm_rows")
    p.add_argument("--rows", default="", help="e.g. 2,4,8: products of a few rows against F.linear's")
    args = p.parse_args()
    torch.manual_seed(0)
    if args.fp8:
        return sweep_fp8()
    if args.rows:
        return sweep_rows([int(r) for r in args.rows.split(",")])
    sweep = tilings(args.quick, args.near)
    shapes = {**SHAPES, "head": (128256, 4096)} if args.near else SHAPES
    print(json.dumps({"tilings": len(sweep)}), flush=True)
    totals: dict[GemvTiling, float] = {}
    for name, (n, k) in shapes.items():
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(COPIES)]
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        ref = F.linear(x.float(), ws[0].float())
        nbytes = n * k * 2
        row: dict[str, object] = {"shape": name, "n": n, "k": k}
        row["linear_us"] = t_lin = timed(lambda ws=ws, x=x: [F.linear(x, w) for w in ws])
        row["linear_gbs"] = round(nbytes / t_lin / 1e3)
        row["read_us"] = t_read = timed(lambda ws=ws: [w.view(-1).max() for w in ws])  # a plain read
        row["read_gbs"] = round(nbytes / t_read / 1e3)
        results = []
        for t in sweep:
            try:
                us = timed(lambda ws=ws, x=x, t=t: [dense_gemv(x, w, tiling=t) for w in ws])
            except Exception as exc:  # noqa: BLE001 (a tiling that does not compile: skipped, named)
                results.append((float("inf"), t, type(exc).__name__))
                continue
            if name in SHAPES:  # a layer's four products (not the head)
                totals[t] = totals.get(t, 0.0) + us
            results.append((us, t, None))
        results.sort(key=lambda r: r[0])
        best = results[0][1]
        err = (dense_gemv(x, ws[0], tiling=best).float() - ref).abs().max().item()
        row["best"] = [{"us": round(us, 2), "gbs": round(nbytes / us / 1e3), **vars(t)} for us, t, e in results[:6] if not e]
        row["best_err"] = err
        row["failed"] = sum(1 for r in results if r[2])
        print(json.dumps(row), flush=True)
    overall = sorted(((v, t) for t, v in totals.items()), key=lambda r: r[0])
    print(json.dumps({"overall_best": [{"layer_us": round(v, 2), **vars(t)} for v, t in overall[:8]]}), flush=True)


def sweep_rows(counts: list[int]) -> None:
    """A few rows: F.linear against dense_gemv's rows kernel over a small grid of tilings; a line a
    shape and row count, then each count's best tiling over a layer's four products."""
    grid = [GemvTiling(*t) for t in itertools.product((1, 2, 4), (256, 512, 1024, 2048), (4, 8), (None,), (8,))]
    for rows in counts:
        totals: dict[GemvTiling, float] = {}
        linear = 0.0
        for name, (n, k) in SHAPES.items():
            ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(COPIES)]
            x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
            t_lin = timed(lambda ws=ws, x=x: [F.linear(x, w) for w in ws])
            linear += t_lin
            results = []
            for t in grid:
                if t.block_n * t.block_k * triton_rows(rows) // (32 * t.num_warps) > 128:
                    continue  # (its accumulators would not fit the registers)
                us = timed(lambda ws=ws, x=x, t=t: [dense_gemv(x, w, tiling=t) for w in ws])
                totals[t] = totals.get(t, 0.0) + us
                results.append((us, t))
            results.sort(key=lambda r: r[0])
            err = (dense_gemv(x, ws[0], tiling=results[0][1]).float() - F.linear(x.float(), ws[0].float())).abs().max().item()
            best = [{"us": round(us, 2), **vars(t)} for us, t in results[:3]]
            print(json.dumps({"rows": rows, "shape": name, "linear_us": round(t_lin, 2), "best": best, "err": err}), flush=True)
        overall = sorted(((v, t) for t, v in totals.items()), key=lambda r: r[0])
        print(json.dumps({"rows": rows, "linear_layer_us": round(linear, 2),
                          "overall_best": [{"layer_us": round(v, 2), **vars(t)} for v, t in overall[:4]]}), flush=True)  # fmt: skip


def triton_rows(rows: int) -> int:
    return 1 << (rows - 1).bit_length()


def sweep_fp8() -> None:
    """The four projections in FP8 (per-channel weight scales, x per token): fp8_gemm_rows (the
    tensor-core rows kernel) against scaled_gemv's tilings."""
    sweep = tilings(False, fp8=True)
    totals: dict[GemvTiling, float] = {}
    for name, (n, k) in SHAPES.items():
        ops = [quantize_weight_fp8(torch.randn(n, k, device="cuda") * 0.02) for _ in range(COPIES)]
        xq, xs = per_token_quant_ref(torch.randn(1, k, device="cuda"))
        ref = (xq.float() @ ops[0][0].float().T) * xs * ops[0][1].view(1, -1)
        row: dict[str, object] = {"shape": name, "fp8": True}
        row["rows_kernel_us"] = t0 = timed(lambda ops=ops, xq=xq, xs=xs: [fp8_gemm_rows(xq, xs, w, s.view(1, -1)) for w, s in ops])
        row["rows_kernel_gbs"] = round(n * k / t0 / 1e3)
        results = []
        for t in sweep:
            us = timed(lambda t=t, ops=ops, xq=xq, xs=xs: [scaled_gemv(xq, xs, w, s, tiling=t) for w, s in ops])
            totals[t] = totals.get(t, 0.0) + us
            results.append((us, t))
        results.sort(key=lambda r: r[0])
        err = (scaled_gemv(xq, xs, *ops[0], tiling=results[0][1]).float() - ref).abs().max().item()
        row["best"] = [{"us": round(us, 2), "gbs": round(n * k / us / 1e3), **vars(t)} for us, t in results[:4]]
        row["best_err"] = err
        print(json.dumps(row), flush=True)
    overall = sorted(((v, t) for t, v in totals.items()), key=lambda r: r[0])
    print(json.dumps({"overall_best": [{"layer_us": round(v, 2), **vars(t)} for v, t in overall[:6]]}), flush=True)


if __name__ == "__main__":
    main()
