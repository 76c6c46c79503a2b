"""GGUF products on CUDA (issue 19) against a bf16 torch matmul, at Llama-3-8B's
projection shapes and the LM head, 1-64 rows: one JSON line per case, times in CUDA graphs
(do_bench_cudagraph), each product cycling through enough copies of its blocks to overflow the
L2 cache, and the bytes read per microsecond. Each form of the product: every weight dequantised
in float32 first, Q4_K / Q5_K's FACTORED (the quants multiplied, then scaled per sub-block), and
the K-quants' LOWP (dequantised in bfloat16, the quants made floats by bits), the
dequantise-then-matmul path at 32 and 64 rows (where the cut between the paths lies), then a
sweep at one row of each form over output channels per program, programs per SM and warps per
program, and of the one-row kernel without tensor cores (GEMV).

The product with int8 activations (DP4A) is timed for Q4_K, Q5_K and Q6_K at one row, over
channels, warps and where the activations are quantised, and for Q4_K and Q5_K at more rows.

    python scripts/bench_gguf.py  (BENCH_GGUF_QUICK=1: the K-quants only, at 1, 4 and 16 rows, the
    LOWP forms also at 2 and 4 pipeline stages; the sweep of the LOWP forms only, over channels,
    programs and pipeline stages)
    BENCH_GGUF_Q6K=1 python scripts/bench_gguf.py  (Q6_K alone at the Q4_K_M 8B file's Q6_K shapes,
    1 and 2 rows: the file's blocks against planes, gguf_gemm.Q6K_ALIGNED; a minute or two)
"""

from __future__ import annotations

import itertools
import json
import os
from collections.abc import Callable

import torch
import triton

from mmserve.kernels import gguf_gemm
from mmserve.kernels.gguf_blocks import FORMATS, LOWP_TYPES, gguf_dequantize
from mmserve.kernels.gguf_gemm import gguf_gemm_rows
from mmserve.kernels.gguf_planes import q6k_planes

SHAPES = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (128256, 4096)]
L2_OVERFLOW = 160e6  # bytes cycled through per timed call (the H200's L2: 50 MB)
QUICK = os.environ.get("BENCH_GGUF_QUICK") == "1"
Q6K_ONLY = os.environ.get("BENCH_GGUF_Q6K") == "1"
Q6K_SHAPES = [(1024, 4096), (4096, 14336), (128256, 4096)]  # Q4_K_M 8B's Q6_K: half the ffn_down, attn_v, the LM head
ROWS = (1, 4, 16) if QUICK else (1, 4, 16, 32, 64)
ROWS_CHECKED = (1, 16) if QUICK else (1, 16, 64)
TYPES_CHECKED = ("Q4_K", "Q5_K", "Q6_K") if QUICK else ("Q4_K", "Q5_K", "Q6_K", "Q8_0", "Q4_1")


# the one-row int8-activation product (gguf_gemm.DP4A): channels a program, warps, quantised first
# (1-2 warps since session 28: w4a16's one-row product gained 10-25% at one warp, its sums then in
# the thread, wna16.DP4A_NUM_WARPS)
_DP4A_TILES = ((32, 1), (64, 1), (128, 1), (64, 2), (64, 4), (128, 4), (128, 8), (256, 8))
_DP4A_FORMS = [(b, w, p) for b, w in _DP4A_TILES for p in (False, True)]


def _time(product: Callable[[int], object], copies: int) -> float:
    def run() -> None:
        for i in range(copies):
            product(i)

    return 1e3 * triton.testing.do_bench_cudagraph(run, rep=100) / copies


def _blocks(qtype: str, n: int, k: int, copies: int) -> list[torch.Tensor]:
    """Random blocks with small finite float16 scales (d and the K-quants' dmin; Q6_K's d is
    last; Q4_1's min)."""
    fmt = FORMATS[qtype]
    out = []
    for _ in range(copies):
        raw = torch.randint(0, 256, (n, k // fmt.elements, fmt.bytes), dtype=torch.uint8, device="cuda")
        scales = (torch.randn(n, k // fmt.elements, 2, device="cuda") * 5e-3).half().view(torch.uint8)
        if qtype == "Q6_K":
            raw[:, :, 208:210] = scales[:, :, :2]
        elif fmt.elements == 256 or fmt.has_min:
            raw[:, :, 0:4] = scales
        else:
            raw[:, :, 0:2] = scales[:, :, :2]
        out.append(raw)
    return out


def _rows_kernel(x: torch.Tensor, blocks: torch.Tensor, qtype: str, block_n: int | None = None,
                 programs: int | None = None, factored: bool | None = None, unroll: int = 1,
                 warps: int = 4, gemv: bool = False, lowp: bool = False, words: bool = False,
                 stages: int | None = None) -> torch.Tensor:  # fmt: skip
    """One form of the few-rows kernel (never the int8-activation one, DP4A, timed apart)."""
    gguf_gemm.LOWP_WORDS = words
    return gguf_gemm_rows(x, blocks, qtype, block_n or gguf_gemm.BLOCK_N, programs, factored, unroll,
                          warps, gemv, lowp, stages, dp4a=False)  # fmt: skip


def _forms(qtype: str) -> list[dict[str, bool]]:
    """The few-rows kernel's forms of the product for qtype: dequantised in float32 (and for
    Q4_K / Q5_K factored), and for the K-quants dequantised in x's dtype (lowp)."""
    forms = [{"factored": False}]
    if qtype in ("Q4_K", "Q5_K"):
        forms.append({"factored": True})
    if qtype in LOWP_TYPES:
        forms.append({"factored": False, "lowp": True})
    if qtype in ("Q4_K", "Q5_K"):  # their scales read as 32-bit words
        forms.append({"factored": False, "lowp": True, "words": True})
    return forms


def _form_name(form: dict[str, bool]) -> str:
    if form.get("lowp"):
        return "lowp_words" if form.get("words") else "lowp"
    return "factored" if form["factored"] else "dequant_tiles"


def _check(qtype: str) -> None:
    """The kernels against the dequantised weight's product, bf16, one shape: the few-rows
    kernel in each form at 1, 16 and 64 rows, the one-row kernel (gemv), and (K-quants) the
    dequantiser in bf16 (lowp) against the float32 one."""
    blocks = _blocks(qtype, 4096, 4096, 1)[0]
    weight = gguf_dequantize(blocks, qtype, torch.float32)
    cases = [(1, {"factored": False, "gemv": True})] + list(itertools.product(ROWS_CHECKED, _forms(qtype)))
    for rows, form in cases:
        x = torch.randn(rows, 4096, device="cuda", dtype=torch.bfloat16)
        ref = x.float() @ weight.t()
        out = _rows_kernel(x, blocks, qtype, **form).float()
        rel = ((out - ref).norm() / ref.norm()).item()
        print(json.dumps({"check": qtype, "rows": rows, **form, "rel_err": rel}), flush=True)
        assert rel < 1e-2, rel
    for pre in (False, True) if qtype in gguf_gemm.DP4A_KERNEL_TYPES else ():  # int8 activations, one row
        x = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16)
        out = gguf_gemm_rows(x, blocks, qtype, dp4a=True, prequant=pre).float()
        ref = x.float() @ weight.t()
        rel = ((out - ref).norm() / ref.norm()).item()
        same = ((out - gguf_gemm.gguf_matmul_dp4a_ref(x, blocks, qtype)).abs().max() / out.abs().max()).item()
        print(json.dumps({"check": qtype, "rows": 1, "dp4a": True, "prequant": pre, "rel_err": rel,
                          "max_err_to_its_ref": same}), flush=True)  # fmt: skip
        assert rel < 2e-2 and same < 1e-2, (rel, same)
    if qtype in LOWP_TYPES:
        low = gguf_dequantize(blocks, qtype, torch.bfloat16, lowp=True).float()
        rel = ((low - weight).norm() / weight.norm()).item()
        print(json.dumps({"check": qtype, "dequantize": "lowp", "rel_err": rel}), flush=True)
        assert rel < 1e-2, rel


def _shape(n: int, k: int, qtype: str) -> None:
    fmt = FORMATS[qtype]
    nbytes = n * (k // fmt.elements) * fmt.bytes
    copies = max(2, int(L2_OVERFLOW // nbytes) + 1)
    dense_copies = max(2, int(L2_OVERFLOW // (n * k * 2)) + 1)
    blocks = _blocks(qtype, n, k, copies)
    weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(dense_copies)]
    for rows in ROWS:
        x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
        line: dict[str, object] = {"qtype": qtype, "n": n, "k": k, "rows": rows}
        for form in _forms(qtype):
            us = _time(lambda i, x=x, f=form: _rows_kernel(x, blocks[i], qtype, **f), copies)
            key = _form_name(form)
            line[f"{key}_us"], line[f"{key}_gbs"] = round(us, 1), round(nbytes / us / 1e3)
            for stages in (2, 4) if QUICK and form.get("lowp") else ():  # the pipeline's depth
                us = _time(lambda i, x=x, f=form, s=stages: _rows_kernel(x, blocks[i], qtype, stages=s, **f), copies)
                line[f"{key}_stages{stages}_us"] = round(us, 1)
        if rows == 1:  # the one-row kernel without tensor cores (gguf_gemm.GEMV)
            us = _time(lambda i, x=x: _rows_kernel(x, blocks[i], qtype, gemv=True), copies)
            line["gemv_us"], line["gemv_gbs"] = round(us, 1), round(nbytes / us / 1e3)
        dp4a_forms = [f for f in _DP4A_FORMS if f[2] or qtype != "Q6_K"]  # Q6_K: quantised first, always
        if rows > 1 and qtype in gguf_gemm.DP4A_TYPES:  # a tile's quants unpacked once for all rows (DP4A_MAX_ROWS)
            us = _time(lambda i, x=x: gguf_gemm_rows(x, blocks[i], qtype, dp4a=True), copies)
            line["dp4a_us"] = round(us, 1)
        for block_n, warps, pre in dp4a_forms if rows == 1 and qtype in gguf_gemm.DP4A_KERNEL_TYPES else ():
            us = _time(lambda i, x=x, b=block_n, w=warps, p=pre: gguf_gemm_rows(
                x, blocks[i], qtype, b, num_warps=w, dp4a=True, prequant=p), copies)  # fmt: skip
            line[f"dp4a{'_prequant' if pre else ''}_{block_n}x{warps}_us"] = round(us, 1)
        if rows >= 16:  # the many-rows path: the weight dequantised, then cuBLAS (lowp: in bf16)
            for low in (False, True) if qtype in LOWP_TYPES else (False,):
                us = _time(lambda i, x=x, low=low: torch.matmul(
                    x, gguf_dequantize(blocks[i], qtype, x.dtype, lowp=low).t()), copies)  # fmt: skip
                line["dequant_matmul_lowp_us" if low else "dequant_matmul_us"] = round(us, 1)
        bf16 = _time(lambda i, x=x: torch.matmul(x, weights[i].t()), dense_copies)
        line["bf16_us"], line["bf16_gbs"] = round(bf16, 1), round(n * k * 2 / bf16 / 1e3)
        print(json.dumps(line), flush=True)
    if (n, k) == (4096, 14336) and qtype in ("Q4_K", "Q6_K"):
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        grid = itertools.product(_forms(qtype), (32, 64, 128), (4, 8), (4, 8), (None,))
        if QUICK:  # the LOWP forms only, at 4 warps, and the pipeline's depth
            grid = ((f, b, p, 4, s) for f in _forms(qtype) if f.get("lowp") for b in (64, 128)
                    for p in (4, 8) for s in (2, 3, 4))  # fmt: skip
        for form, block_n, programs, warps, stages in grid:
            us = _time(lambda i, b=block_n, p=programs, w=warps, f=form, s=stages:
                       _rows_kernel(x, blocks[i], qtype, b, p, warps=w, stages=s, **f), copies)  # fmt: skip
            print(json.dumps({"sweep": [qtype, n, k, 1], "form": _form_name(form), "block_n": block_n,
                              "programs_per_sm": programs, "num_warps": warps, "num_stages": stages,
                              "us": round(us, 1), "gbs": round(nbytes / us / 1e3)}), flush=True)  # fmt: skip
        for block_n, programs in itertools.product((16, 32, 64), (4, 8)) if not QUICK else ():
            us = _time(lambda i, b=block_n, p=programs: _rows_kernel(x, blocks[i], qtype, b, p, gemv=True), copies)
            print(json.dumps({"sweep": [qtype, n, k, 1], "gemv": True, "block_n": block_n,
                              "programs_per_sm": programs, "us": round(us, 1),
                              "gbs": round(nbytes / us / 1e3)}), flush=True)  # fmt: skip


def _q6k_planes_shape(n: int, k: int) -> None:
    """Q6_K at 1 and 2 rows, the file's blocks against planes (q6k_planes): LOWP (the default), the
    dp4a kernel over channels and warps, bf16; at one row first checked against its reference."""
    nbytes = n * (k // 256) * 210
    copies = max(2, int(L2_OVERFLOW // nbytes) + 1)
    blocks = _blocks("Q6_K", n, k, copies)
    planes = [q6k_planes(b) for b in blocks]
    dense_copies = max(2, int(L2_OVERFLOW // (n * k * 2)) + 1)
    weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(dense_copies)]
    if n * k <= 4096 * 14336:  # (the reference dequantises on the CPU: not the LM head)
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        out = gguf_gemm_rows(x, planes[0], "Q6_K", dp4a=True).float()
        ref = gguf_gemm.gguf_matmul_dp4a_ref(x, blocks[0], "Q6_K")
        same = ((out - ref).abs().max() / ref.abs().max()).item()
        print(json.dumps({"check": "Q6_K planes dp4a", "n": n, "k": k, "max_err_to_its_ref": same}), flush=True)
        assert same < 1e-2, same
    for rows in (1, 2):
        x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
        line: dict[str, object] = {"qtype": "Q6_K", "n": n, "k": k, "rows": rows}
        for name, ws in (("blocks", blocks), ("planes", planes)):
            us = _time(lambda i, x=x, ws=ws: gguf_gemm_rows(x, ws[i], "Q6_K", dp4a=False), copies)
            line[f"{name}_lowp_us"], line[f"{name}_lowp_gbs"] = round(us, 1), round(nbytes / us / 1e3)
            for block_n, warps in _DP4A_TILES if rows == 1 else ():
                us = _time(lambda i, x=x, ws=ws, b=block_n, w=warps: gguf_gemm_rows(
                    x, ws[i], "Q6_K", b, num_warps=w, dp4a=True), copies)  # fmt: skip
                line[f"{name}_dp4a_{block_n}x{warps}_us"] = round(us, 1)
                line[f"{name}_dp4a_{block_n}x{warps}_gbs"] = round(nbytes / us / 1e3)
        bf16 = _time(lambda i, x=x: torch.matmul(x, weights[i].t()), dense_copies)
        line["bf16_us"] = round(bf16, 1)
        print(json.dumps(line), flush=True)


def main() -> None:
    torch.manual_seed(0)
    if Q6K_ONLY:
        for n, k in Q6K_SHAPES:
            _q6k_planes_shape(n, k)
        return
    defaults = {name: getattr(gguf_gemm, name)
                for name in ("FACTORED", "GEMV", "LOWP", "LOWP_WORDS", "MAX_ROWS", "DP4A", "NUM_STAGES")}  # fmt: skip
    gguf_gemm.MAX_ROWS = 64  # the few-rows kernel timed past its cut too
    for qtype in TYPES_CHECKED:
        _check(qtype)
    for qtype in ("Q4_K", "Q6_K"):
        for n, k in SHAPES:
            if qtype == "Q4_K" and n == 128256:
                continue  # Q4_K_M's LM head is Q6_K
            _shape(n, k, qtype)
    _shape(4096, 14336, "Q5_K")  # Q5_K_M's main type
    for qtype in ("Q8_0", "Q4_1") if not QUICK else ():  # SmolLM2's GGUF types
        _shape(4096, 4096, qtype)
    print(json.dumps({"defaults": defaults}))


if __name__ == "__main__":
    main()
