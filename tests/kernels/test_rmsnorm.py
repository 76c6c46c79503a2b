import pytest
import torch

from mmserve.kernels.rmsnorm import (
    fused_add_rms_norm,
    fused_add_rms_norm_ref,
    rms_norm,
    rms_norm_ref,
)


@pytest.mark.parametrize("shape", [(1, 37), (5, 1000), (2, 3, 129)])
def test_rms_norm(shape, dtype, device, tol):
    x = torch.randn(shape, dtype=dtype, device=device) * 3
    weight = torch.randn(shape[-1], dtype=dtype, device=device)
    torch.testing.assert_close(rms_norm(x, weight, 1e-6), rms_norm_ref(x, weight, 1e-6), **tol)


@pytest.mark.parametrize("shape", [(1, 37), (7, 1000)])
def test_fused_add_rms_norm(shape, dtype, device, tol):
    x = torch.randn(shape, dtype=dtype, device=device)
    residual = torch.randn(shape, dtype=dtype, device=device)
    weight = torch.randn(shape[-1], dtype=dtype, device=device)
    x_before, residual_before = x.clone(), residual.clone()
    out, residual_out = fused_add_rms_norm(x, residual, weight, 1e-5)
    expected_out, expected_residual = fused_add_rms_norm_ref(x, residual, weight, 1e-5)
    torch.testing.assert_close(residual_out, expected_residual, atol=0, rtol=0)
    torch.testing.assert_close(out, expected_out, **tol)
    assert torch.equal(x, x_before) and torch.equal(residual, residual_before)


def test_strided_input_and_float32_weight(device, tol_f32):
    x = torch.randn(6, 2 * 96, device=device)[:, :96]  # every other row block: non-contiguous
    weight = torch.rand(96, device=device) + 0.5
    torch.testing.assert_close(rms_norm(x, weight, 1e-6), rms_norm_ref(x, weight, 1e-6), **tol_f32)


def test_rejects_bad_inputs(device):
    x = torch.randn(3, 16, device=device)
    with pytest.raises(ValueError, match="weight must have shape"):
        rms_norm(x, torch.randn(15, device=device), 1e-6)
    with pytest.raises(ValueError, match="residual must have shape"):
        fused_add_rms_norm(x, x[:2], torch.randn(16, device=device), 1e-6)
    with pytest.raises(ValueError, match="residual must have x's dtype"):
        fused_add_rms_norm(x, x.half(), torch.randn(16, device=device), 1e-6)
    with pytest.raises(ValueError, match="eps must be > 0"):
        rms_norm(x, torch.randn(16, device=device), 0.0)
    with pytest.raises(ValueError, match="x must be float32"):
        rms_norm(x.int(), torch.randn(16, device=device), 1e-6)
