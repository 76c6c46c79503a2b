"""One-row bf16 products of the 8B shape's projections (target 1, issue 23): cuBLAS's F.linear
against the same product cut into S slices of K run as one strided batched product (torch.bmm
on a view of the weight, no copy) and summed. Weights rotate through 16 copies a shape, as a
step's 32 layers do, so the L2 cache does not hold them. CUDA graphs of 16 products, timed by
events; us a product and the bytes' rate. Also torch.mv, the weight stored transposed and
cuBLASLt for the same product. Prints JSON lines."""

from __future__ import annotations

import json

import torch
import torch.nn.functional as F

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
COPIES = 16


def timed(fn, reps: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        g.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / reps / COPIES  # us a product


def main() -> None:
    torch.manual_seed(0)
    for name, (n, k) in SHAPES.items():
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(COPIES)]
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        ref = F.linear(x.float(), ws[0].float())
        nbytes = n * k * 2
        row = {"shape": name, "n": n, "k": k}
        row["linear_us"] = t = timed(lambda ws=ws, x=x: [F.linear(x, w) for w in ws])
        row["linear_gbs"] = nbytes / t / 1e3
        # other routes to the same product: torch.mv (a GEMV call), the weight stored
        # transposed ([K, N]: cuBLAS's other layout), cuBLASLt in place of cuBLAS
        row["mv_us"] = timed(lambda ws=ws, x=x: [torch.mv(w, x[0]) for w in ws])
        wts = [w.t().contiguous() for w in ws]
        row["transposed_us"] = timed(lambda wts=wts, x=x: [torch.mm(x, w) for w in wts])
        row["transposed_err"] = (torch.mm(x, wts[0]).float() - ref).abs().max().item()
        del wts
        torch.backends.cuda.preferred_blas_library("cublaslt")
        row["cublaslt_us"] = timed(lambda ws=ws, x=x: [F.linear(x, w) for w in ws])
        torch.backends.cuda.preferred_blas_library("cublas")
        for s in (2, 3, 4, 8):
            if k % s:
                continue
            xs = x.view(1, s, k // s).transpose(0, 1)  # [S, 1, K/S]
            views = [w.view(n, s, k // s).permute(1, 2, 0) for w in ws]  # [S, K/S, N], no copy

            def cut(v=views, xs=xs):
                return [torch.bmm(xs, w).sum(0) for w in v]

            err = (cut()[0].float() - ref).abs().max().item()
            t = timed(cut)
            row[f"split{s}_us"], row[f"split{s}_gbs"], row[f"split{s}_err"] = t, nbytes / t / 1e3, err

            def bmm_only(v=views, xs=xs):
                return [torch.bmm(xs, w) for w in v]

            row[f"split{s}_bmm_us"] = timed(bmm_only)
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
