"""Programmatic dependent launch (kernels._common.PDL) is asked of Triton only where it exists:
CUDA of compute capability 9.0 or later, never under the interpreter or on the CPU (whose
launches would refuse launch_pdl or run without the grid dependencies it needs). Its effect
on the GPU: tests/gpu/test_gpu_pdl.py."""

from __future__ import annotations

import torch
import triton

from mmserve.kernels import _common
from mmserve.kernels.rmsnorm import rms_norm, rms_norm_ref


def test_pdl_is_never_asked_of_the_cpu(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setattr(_common, "PDL", True)
    assert _common.pdl_launch(torch.device("cpu")) == {"PDL": False}
    if not triton.knobs.runtime.interpret:
        return  # (on the GPU machine, without the interpreter, CPU tensors cannot reach a kernel)
    x, w = torch.randn(3, 64), torch.rand(64) + 0.5  # a kernel with the wait still runs here
    torch.testing.assert_close(rms_norm(x, w, 1e-6), rms_norm_ref(x, w, 1e-6))
