"""The activation quantisation fused into residual-add + RMSNorm and SiLU-and-mul
(mmserve/kernels/rmsnorm.py add_rms_norm_quant, mmserve/kernels/activation.py silu_and_mul_quant) against the
unfused pair of kernels they replace (the norm or activation, then mmserve/kernels/quant.py's
per-token quantisation), in CUDA graphs, bf16 in, int8 and FP8 out, at Llama-3-8B's widths
(hidden 4096; intermediate 14336, its input 2 x 14336) and decode to prefill row counts. One
JSON line per case, times in microseconds. Decides models/quantized_input.py's
FUSE_ACTIVATION_QUANT.

    python scripts/bench_fused_quant.py
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable

import torch
import triton

from mmserve.kernels.activation import silu_and_mul, silu_and_mul_quant
from mmserve.kernels.quant import FP8_DTYPE, per_token_quant_fp8, per_token_quant_int8
from mmserve.kernels.rmsnorm import add_rms_norm_quant, fused_add_rms_norm

ROWS = (1, 16, 64, 512, 4096, 8192)
HIDDEN, INTERMEDIATE = 4096, 14336
OUT_DTYPES = {"int8": torch.int8, "fp8": FP8_DTYPE}


def _us(fn: Callable[[], object]) -> float:
    return round(triton.testing.do_bench_cudagraph(fn, rep=100) * 1e3, 2)


def _quant(out_dtype: torch.dtype) -> Callable[[torch.Tensor], object]:
    return per_token_quant_int8 if out_dtype == torch.int8 else per_token_quant_fp8


def _cases(rows: int, name: str, out_dtype: torch.dtype) -> list[dict]:
    quant = _quant(out_dtype)
    x = torch.randn(rows, HIDDEN, device="cuda", dtype=torch.bfloat16)
    residual = torch.randn_like(x)
    weight = torch.randn(HIDDEN, device="cuda", dtype=torch.bfloat16)
    gate_up = torch.randn(rows, 2 * INTERMEDIATE, device="cuda", dtype=torch.bfloat16)
    norm = {
        "fused": _us(lambda: add_rms_norm_quant(x, residual, weight, 1e-6, out_dtype)),
        "unfused": _us(lambda: quant(fused_add_rms_norm(x, residual, weight, 1e-6)[0])),
    }
    act = {
        "fused": _us(lambda: silu_and_mul_quant(gate_up, out_dtype)),
        "unfused": _us(lambda: quant(silu_and_mul(gate_up))),
    }
    return [
        {"op": "add_rms_norm_quant", "quant": name, "rows": rows, "width": HIDDEN, **norm,
         "speedup": round(norm["unfused"] / norm["fused"], 2)},
        {"op": "silu_and_mul_quant", "quant": name, "rows": rows, "width": INTERMEDIATE, **act,
         "speedup": round(act["unfused"] / act["fused"], 2)},
    ]  # fmt: skip


def main() -> None:
    torch.manual_seed(0)
    for (name, out_dtype), rows in itertools.product(OUT_DTYPES.items(), ROWS):
        for line in _cases(rows, name, out_dtype):
            print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
