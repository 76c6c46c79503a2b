import pytest
import torch

from mmserve.kernels.layernorm import add_layer_norm, add_layer_norm_ref


@pytest.mark.parametrize("shape", [(1, 37), (7, 768), (2, 3, 1000)])
def test_add_layer_norm(shape, dtype, device, tol):
    gen = torch.Generator(device=device).manual_seed(shape[-1])
    x = torch.randn(shape, dtype=dtype, device=device, generator=gen) * 3 + 1  # mean != 0
    residual = torch.randn(shape, dtype=dtype, device=device, generator=gen)
    weight = torch.randn(shape[-1], dtype=dtype, device=device, generator=gen)
    bias = torch.randn(shape[-1], dtype=dtype, device=device, generator=gen)
    x_before, residual_before = x.clone(), residual.clone()
    out = add_layer_norm(x, residual, weight, bias, 1e-12)
    torch.testing.assert_close(out, add_layer_norm_ref(x, residual, weight, bias, 1e-12), **tol)
    assert out.dtype == dtype and out.shape == x.shape
    assert torch.equal(x, x_before) and torch.equal(residual, residual_before)


def test_strided_inputs_and_float32_affine(device, tol_f32):
    x = torch.randn(6, 2 * 96, device=device)[:, :96]  # non-contiguous rows
    residual = torch.randn(6, 96, device=device)
    weight, bias = torch.rand(96, device=device) + 0.5, torch.randn(96, device=device)
    want = add_layer_norm_ref(x, residual, weight, bias, 1e-5)
    torch.testing.assert_close(add_layer_norm(x, residual, weight, bias, 1e-5), want, **tol_f32)


def test_constant_rows_give_the_bias(device):
    """Zero variance: eps keeps rstd finite and every value is the bias."""
    x = torch.full((3, 64), 2.0, device=device)
    bias = torch.randn(64, device=device)
    out = add_layer_norm(x, torch.zeros_like(x), torch.ones(64, device=device), bias, 1e-12)
    torch.testing.assert_close(out, bias.expand(3, 64))


def test_rejects_bad_inputs(device):
    x, w = torch.randn(3, 16, device=device), torch.randn(16, device=device)
    with pytest.raises(ValueError, match="residual must have shape"):
        add_layer_norm(x, x[:2], w, w, 1e-6)
    with pytest.raises(ValueError, match="bias must have shape"):
        add_layer_norm(x, x, w, w[:15], 1e-6)
    with pytest.raises(ValueError, match="residual must have x's dtype"):
        add_layer_norm(x, x.half(), w, w, 1e-6)
    with pytest.raises(ValueError, match="eps must be > 0"):
        add_layer_norm(x, x, w, w, 0.0)
