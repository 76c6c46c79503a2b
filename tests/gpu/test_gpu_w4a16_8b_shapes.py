"""w4a16's one-row int8-activation product (wna16.DP4A) at the 8B shape's projections on the GPU:
finite, and its own arithmetic's reference (wna16_dp4a_ref) to rounding, eager and replayed from
a CUDA graph, with programmatic dependent launch and the split products' in-place sums each on
and off. (Session 27's knob sweep on an H100 printed a NaN relative error at gate_up and down,
PDL and SERIAL_SPLITS on, while qkv and o were finite: this finds which setting, if any, is
at fault.) Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

from mmserve.kernels import _common
from mmserve.kernels.wna16 import pack_columns, wna16_dp4a_ref, wna16_gemm

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}  # (N, K)


@pytest.mark.parametrize("serial", [True, False], ids=["serial", "sum_splits"])
@pytest.mark.parametrize("pdl", [True, False], ids=["pdl", "no_pdl"])
@pytest.mark.parametrize("shape", list(SHAPES), ids=list(SHAPES))
def test_gpu_w4a16_product_at_8b_shapes(shape: str, pdl: bool, serial: bool, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setattr(_common, "PDL", pdl)
    monkeypatch.setattr(_common, "SERIAL_SPLITS", serial)
    n, k = SHAPES[shape]
    g = torch.Generator().manual_seed(n + k)
    q = pack_columns(torch.randint(0, 16, (k, n), generator=g), 4).cuda()
    scales = (torch.rand(k // 128, n, generator=g) * 0.02 + 0.001).to(torch.bfloat16).cuda()
    x = torch.randn(1, k, generator=g).to(torch.bfloat16).cuda()
    own = wna16_dp4a_ref(x, q, scales, None, 4, 128)
    out = wna16_gemm(x, q, scales, None, 4, 128, dp4a=True)
    torch.cuda.synchronize()
    assert torch.isfinite(out).all(), f"{(~torch.isfinite(out)).sum().item()} outputs not finite"
    assert ((out.float() - own).abs().max() / own.abs().max()).item() < 1e-2
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = wna16_gemm(x, q, scales, None, 4, 128, dp4a=True)
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(replayed, out)
