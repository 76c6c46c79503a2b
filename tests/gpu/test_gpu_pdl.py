"""Programmatic dependent launch (kernels._common.PDL) on the GPU: a decode layer's chain of
Triton kernels (RMSNorm with the residual, the int8-activation products of w4a16 and GGUF
Q4_K with their K split and summed by their last program, SiLU-and-mul, FP8's per-token
quantisation and rows product) replayed from a CUDA graph with each kernel free to start
before the one it reads has ended: the results equal the same chain launched without it, to
the bit (a kernel reading its input early would differ), and its torch reference within
rounding. The whole GPU suite also runs under it: `pytest tests/gpu tests/kernels --pdl`.
Skipped without CUDA of compute capability 9.0 or later."""

from __future__ import annotations

import pytest
import torch

from mmserve.kernels import _common
from mmserve.kernels.activation import silu_and_mul, silu_and_mul_ref
from mmserve.kernels.fp8_gemm import fp8_gemm_rows
from mmserve.kernels.gguf_blocks import gguf_dequantize_ref
from mmserve.kernels.gguf_gemm import gguf_matmul
from mmserve.kernels.quant import per_token_quant_fp8
from mmserve.kernels.rmsnorm import fused_add_rms_norm, rms_norm
from mmserve.kernels.wna16 import pack_columns, wna16_gemm, wna16_gemm_ref
from tests.gpu.test_gpu_gguf import _blocks

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0),
        reason="needs CUDA of compute capability 9.0 or later",
    ),
]

HIDDEN, INTER, LAYERS = 1024, 2816, 12


def _weights(seed: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    layers = []
    for layer in range(LAYERS):
        layers.append({
            "norm": (1 + 0.1 * torch.randn(HIDDEN, generator=g)).to(torch.bfloat16).cuda(),
            # w4a16 gate_up: [K, N] packed by columns, scales [K / 128, N]
            "qweight": pack_columns(torch.randint(0, 16, (HIDDEN, 2 * INTER), generator=g), 4).cuda(),
            "scales": (torch.rand(HIDDEN // 128, 2 * INTER, generator=g) * 0.01 + 0.002).to(torch.bfloat16).cuda(),
            "down": _blocks("Q4_K", HIDDEN, INTER, 1000 * seed + layer),  # [N, K] in blocks
            "w8": (torch.randn(HIDDEN, HIDDEN, generator=g) * 0.5).to(torch.float8_e4m3fn).cuda(),
            "w8_scale": torch.full((1, HIDDEN), 0.05, device="cuda"),
        })  # fmt: skip
    return layers


def _chain(x: torch.Tensor, layers: list[dict[str, torch.Tensor]]) -> torch.Tensor:
    residual = None
    for w in layers:
        if residual is None:
            h, residual = rms_norm(x, w["norm"], 1e-6), x
        else:
            h, residual = fused_add_rms_norm(x, residual, w["norm"], 1e-6)
        act = silu_and_mul(wna16_gemm(h, w["qweight"], w["scales"], None, 4, 128))
        xq, xs = per_token_quant_fp8(gguf_matmul(act, w["down"], "Q4_K"))
        x = fp8_gemm_rows(xq, xs, w["w8"], w["w8_scale"], torch.bfloat16)
    return fused_add_rms_norm(x, residual, layers[0]["norm"], 1e-6)[0]


def _chain_ref(x: torch.Tensor, layers: list[dict[str, torch.Tensor]]) -> torch.Tensor:
    def norm(v: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        v = v.float()
        return (v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + 1e-6) * weight.float()).to(torch.bfloat16)

    residual = None
    for w in layers:
        residual = x if residual is None else (x.float() + residual.float()).to(torch.bfloat16)
        h = norm(residual, w["norm"])
        act = silu_and_mul_ref(wna16_gemm_ref(h, w["qweight"], w["scales"], None, 4, 128).to(torch.bfloat16))
        down = (act.float() @ gguf_dequantize_ref(w["down"], "Q4_K").cuda().t()).to(torch.bfloat16)
        x = (down.float() @ (w["w8"].float() * w["w8_scale"].t()).t()).to(torch.bfloat16)
    return norm((x.float() + residual.float()).to(torch.bfloat16), layers[0]["norm"])


@pytest.mark.parametrize("rows", [1, 2])
def test_gpu_chain_under_pdl_equals_without(rows: int, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    layers = _weights(rows)
    x = torch.randn(rows, HIDDEN, device="cuda", dtype=torch.bfloat16)
    monkeypatch.setattr(_common, "PDL", False)
    plain = _chain(x, layers)
    monkeypatch.setattr(_common, "PDL", True)
    assert _common.pdl_launch(x.device) == {"PDL": True, "launch_pdl": True}
    eager = _chain(x, layers)
    static_x = x.clone()
    _chain(static_x, layers)  # (compiled and warm before the capture)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = _chain(static_x, layers)
    outs = []
    for _ in range(5):
        graph.replay()
        outs.append(static_out.clone())
    torch.cuda.synchronize()
    assert torch.equal(eager, plain)
    for out in outs:
        assert torch.equal(out, plain)
    one = _chain(x, layers[:1]).float()  # (a layer against its torch reference: 12 compound roundings)
    ref = _chain_ref(x, layers[:1]).float()
    rel = ((one - ref).norm() / ref.norm()).item()
    assert rel < 0.1, rel  # (the int8 activations' and FP8's roundings)
