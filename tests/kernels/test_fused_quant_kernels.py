"""RMSNorm and SiLU-and-mul with the per-token quantisation fused in (mmserve/kernels/rmsnorm.py
add_rms_norm_quant, mmserve/kernels/activation.py silu_and_mul_quant) against the unfused kernels run
one after the other (bit for bit) and the torch references; odd row counts and widths, a zero
row, static scales, the SiLU kernel's two-pass path for wide rows.

INT8 is exact on CPU too; FP8's scheme is tested with float16 / float32 out dtypes under the
interpreter (its float8 rounding is wrong), with float8 itself on CUDA.
"""

from __future__ import annotations

import pytest
import torch

from mmserve.kernels import activation
from mmserve.kernels.activation import silu_and_mul, silu_and_mul_quant, silu_and_mul_quant_ref
from mmserve.kernels.quant import FP8_DTYPE, per_token_quant_fp8, per_token_quant_int8
from mmserve.kernels.rmsnorm import (
    add_rms_norm_quant,
    add_rms_norm_quant_ref,
    fused_add_rms_norm,
    rms_norm,
)
from tests.kernels.conftest import DEVICE

OUT_DTYPES = [torch.int8, torch.float32, torch.float16] + ([FP8_DTYPE] if DEVICE.type == "cuda" else [])
# widths not a power of two; 1-64 rows, one program each (64 in INT8 only: the interpreter's time;
# 300 rows took 6-7 s a case)
CASES = [(shape, out) for shape in [(1, 37), (7, 1000)] for out in OUT_DTYPES]
CASES += [((64, 129), torch.int8)]


def unfused_quant(
    out: torch.Tensor, out_dtype: torch.dtype, static: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    out = out.reshape(-1, out.shape[-1])
    if out_dtype == torch.int8:
        return per_token_quant_int8(out)
    return per_token_quant_fp8(out, out_dtype, static)


def inputs(shape: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
    scales = torch.logspace(-2, 1, shape[0], device=DEVICE)[:, None]  # rows decades apart
    x = (torch.randn(shape, device=DEVICE) * scales).to(dtype)
    if shape[0] > 2:
        x[2] = 0.0  # a zero row: the minimum scale, zeros
    return x


def assert_same(got: tuple[torch.Tensor, ...], want: tuple[torch.Tensor, ...]) -> None:
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype and g.shape == w.shape
        assert torch.equal(g.float(), w.float()), (g.float() - w.float()).abs().max()


def assert_near_reference(
    q: torch.Tensor, scale: torch.Tensor, q_ref: torch.Tensor, scale_ref: torch.Tensor
) -> None:
    """The reference's unquantised value may differ from the kernel's in its last bit, and so
    move a quantised value to its neighbouring one, rarely."""
    torch.testing.assert_close(scale, scale_ref, rtol=2e-3, atol=0)
    got, want = q.float(), q_ref.float()
    if q.dtype in (torch.float32, torch.float16):  # FP8's scheme, unrounded
        torch.testing.assert_close(got, want, rtol=2e-3, atol=1e-2)
        return
    step = 1.0 if q.dtype == torch.int8 else (want.abs() / 8).clamp(min=2**-9) * 1.01  # FP8's
    assert ((got - want).abs() <= step).all()
    assert (got != want).float().mean() < 0.01


@pytest.mark.parametrize("shape,out_dtype", CASES, ids=str)
@pytest.mark.parametrize("with_residual", [True, False], ids=["residual", "alone"])
def test_add_rms_norm_quant_is_the_two_kernels(shape, out_dtype, with_residual, dtype):
    x = inputs(shape, dtype)
    residual = inputs(shape, dtype) if with_residual else None
    weight = torch.randn(shape[1], device=DEVICE).to(dtype)
    q, scale, summed = add_rms_norm_quant(x, residual, weight, 1e-6, out_dtype)
    if residual is None:
        normed, want_summed = rms_norm(x, weight, 1e-6), x
    else:
        normed, want_summed = fused_add_rms_norm(x, residual, weight, 1e-6)
    assert_same((q, scale, summed), (*unfused_quant(normed, out_dtype), want_summed))
    q_ref, scale_ref, summed_ref = add_rms_norm_quant_ref(x, residual, weight, 1e-6, out_dtype)
    assert torch.equal(summed, summed_ref)
    assert_near_reference(q, scale, q_ref, scale_ref)


@pytest.mark.parametrize("shape,out_dtype", CASES, ids=str)
@pytest.mark.parametrize("two_passes", [False, True], ids=["in_registers", "two_passes"])
def test_silu_and_mul_quant_is_the_two_kernels(shape, out_dtype, two_passes, dtype, monkeypatch):
    if two_passes:  # rows wider than the registers' limit: the max pass, then the values
        monkeypatch.setattr(activation, "_ROW_IN_REGISTERS", 256)
        monkeypatch.setattr(activation, "_LOOP_BLOCK", 64)
    x = inputs((shape[0], 2 * shape[1]), dtype)
    q, scale = silu_and_mul_quant(x, out_dtype)
    assert_same((q, scale), unfused_quant(silu_and_mul(x), out_dtype))
    assert_near_reference(q, scale, *silu_and_mul_quant_ref(x, out_dtype))


@pytest.mark.parametrize("two_passes", [False, True], ids=["in_registers", "two_passes"])
def test_a_static_scale_is_every_row_scale(two_passes, monkeypatch):
    if two_passes:
        monkeypatch.setattr(activation, "_ROW_IN_REGISTERS", 256)
        monkeypatch.setattr(activation, "_LOOP_BLOCK", 64)
    static = torch.tensor([0.01], device=DEVICE)
    x, residual = inputs((5, 300), torch.float32), inputs((5, 300), torch.float32)
    weight = torch.randn(300, device=DEVICE)
    q, scale, _ = add_rms_norm_quant(x, residual, weight, 1e-6, torch.float32, static)
    normed, _ = fused_add_rms_norm(x, residual, weight, 1e-6)
    assert_same((q, scale), unfused_quant(normed, torch.float32, static))
    assert (scale == 0.01).all() and q.abs().max() == 448.0  # saturated: the scale is small
    q, scale = silu_and_mul_quant(x, torch.float32, static)
    assert_same((q, scale), unfused_quant(silu_and_mul(x), torch.float32, static))


def test_leading_dimensions_flatten_into_rows():
    x = inputs((6, 2 * 50), torch.float32).view(2, 3, 100)
    q, scale = silu_and_mul_quant(x, torch.int8)
    assert q.shape == (6, 50) and scale.shape == (6, 1)
    q, scale, summed = add_rms_norm_quant(x, x, torch.ones(100, device=DEVICE), 1e-6, torch.int8)
    assert q.shape == (6, 100) and scale.shape == (6, 1) and summed.shape == (2, 3, 100)


def test_bad_arguments_are_refused():
    x = torch.randn(3, 16, device=DEVICE)
    with pytest.raises(ValueError, match="out_dtype must be int8 or one of"):
        add_rms_norm_quant(x, None, torch.ones(16, device=DEVICE), 1e-6, torch.int16)
    with pytest.raises(ValueError, match="static_scale must be one float32 element"):
        silu_and_mul_quant(x, torch.float32, torch.ones(2, device=DEVICE))
    with pytest.raises(ValueError, match="2 \\* intermediate"):
        silu_and_mul_quant(x[:, :15], torch.int8)
