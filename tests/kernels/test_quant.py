"""Per-token FP8 activation quantisation (mmserve/kernels/quant.py) against its torch reference.

Under the interpreter (CPU) float8 rounding is wrong, so there the kernel writes float16 or
float32 (checking the row max, the scale and the clamp); float8 itself runs on CUDA.
"""

import pytest
import torch

from mmserve.kernels.quant import (
    FP8_DTYPE,
    FP8_MAX,
    MIN_SCALE,
    per_token_quant_fp8,
    per_token_quant_ref,
)
from tests.kernels.conftest import DEVICE

OUT_DTYPES = [torch.float32, torch.float16] + ([FP8_DTYPE] if DEVICE.type == "cuda" else [])
SHAPES = [(1, 16), (5, 100), (3, 4096), (2, 4096 + 17), (4, 14336)]  # one block; several; a tail


@pytest.mark.parametrize("out_dtype", OUT_DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_matches_the_reference(shape, out_dtype, dtype, device):
    scales = torch.logspace(-3, 3, shape[0], device=device)[:, None]  # rows 6 decades apart
    x = (torch.randn(shape, device=device) * scales).to(dtype)
    q, scale = per_token_quant_fp8(x, out_dtype)
    q_ref, scale_ref = per_token_quant_ref(x, out_dtype)
    assert q.dtype == out_dtype and scale.shape == (shape[0], 1) and scale.dtype == torch.float32
    torch.testing.assert_close(scale, scale_ref, rtol=1e-6, atol=0)
    _assert_q_close(q, q_ref, out_dtype)
    assert q.float().abs().amax() <= FP8_MAX


def _assert_q_close(q: torch.Tensor, q_ref: torch.Tensor, out_dtype: torch.dtype) -> None:
    if out_dtype == FP8_DTYPE:
        # x / scale may differ in its last bit between the two: at most a rare element rounds
        # to the neighbouring FP8 value
        differ = q.float() != q_ref.float()
        assert differ.float().mean() < 1e-3
        step = (q_ref.float().abs() / 8).clamp(min=2**-9)
        assert ((q.float() - q_ref.float()).abs() <= step * 1.01).all()
    else:
        rtol = 2e-3 if out_dtype == torch.float16 else 1e-6
        torch.testing.assert_close(q.float(), q_ref.float(), rtol=rtol, atol=0)


def test_each_row_reaches_the_fp8_max(device):
    x = torch.randn(6, 300, device=device) * torch.arange(1, 7, device=device)[:, None]
    q, scale = per_token_quant_fp8(x, torch.float32)
    torch.testing.assert_close(q.abs().amax(1), torch.full((6,), FP8_MAX, device=device))
    torch.testing.assert_close(q * scale, x, rtol=1e-5, atol=1e-6)  # fp32 out: no rounding


def test_a_zero_row_gets_the_minimum_scale_and_zeros(device):
    x = torch.zeros(2, 64, device=device)
    x[1, 3] = 1.0
    q, scale = per_token_quant_fp8(x, torch.float32)
    assert scale[0, 0].item() == pytest.approx(MIN_SCALE) and (q[0] == 0).all()
    assert q[1, 3].item() == pytest.approx(FP8_MAX)


def test_non_contiguous_rows(device):
    x = torch.randn(4, 2 * 96, device=device)[:, ::2]  # stride 2 in the last dimension
    q, scale = per_token_quant_fp8(x, torch.float32)
    q_ref, scale_ref = per_token_quant_ref(x.contiguous(), torch.float32)
    torch.testing.assert_close(q, q_ref)
    torch.testing.assert_close(scale, scale_ref)


def test_empty_and_bad_inputs(device):
    q, scale = per_token_quant_fp8(torch.randn(0, 32, device=device), torch.float32)
    assert q.shape == (0, 32) and scale.shape == (0, 1)
    with pytest.raises(ValueError, match="2-D"):
        per_token_quant_fp8(torch.randn(2, 3, 32, device=device))
    with pytest.raises(ValueError, match="out_dtype"):
        per_token_quant_fp8(torch.randn(2, 32, device=device), torch.int8)
    with pytest.raises(ValueError, match="x must be float"):
        per_token_quant_fp8(torch.ones(2, 32, dtype=torch.int32, device=device))


@pytest.mark.parametrize("out_dtype", OUT_DTYPES, ids=str)
def test_a_static_scale_is_used_for_every_row_and_clamps(out_dtype, device):
    x = torch.randn(5, 300, device=device) * torch.logspace(-2, 1, 5, device=device)[:, None]
    static = torch.tensor([0.01], device=device)  # rows past 4.48 in magnitude saturate
    q, scale = per_token_quant_fp8(x, out_dtype, static_scale=static)
    q_ref, scale_ref = per_token_quant_ref(x, out_dtype, static_scale=static)
    torch.testing.assert_close(scale, torch.full((5, 1), 0.01, device=device))
    torch.testing.assert_close(scale_ref, scale)
    _assert_q_close(q, q_ref, out_dtype)
    assert q.float().abs().amax().item() == pytest.approx(FP8_MAX)  # the loud rows clamped
    with pytest.raises(ValueError, match="static_scale"):
        per_token_quant_fp8(x, static_scale=torch.tensor([1.0, 2.0], device=device))
