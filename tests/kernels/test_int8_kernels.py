"""The INT8 w8a8 kernels against models/int8.py's torch reference: per-token quantisation equal
to quantize_rows (scales and values, ties to even, zero rows), the rows kernel's int8 products
equal to the exact integer sums times the scales, and the int32 epilogue; odd sizes."""

import pytest
import torch

from mmserve.kernels.fp8_gemm import fp8_gemm_rows, scale_product
from mmserve.kernels.quant import per_token_quant_int8
from mmserve.models.int8 import quantize_rows
from tests.kernels.conftest import DEVICE


@pytest.mark.parametrize("shape", [(1, 7), (5, 300), (33, 4097)], ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_quantisation_is_quantize_rows(shape, dtype):  # type: ignore[no-untyped-def]
    torch.manual_seed(shape[1])
    x = (torch.randn(shape) * 3).to(dtype)
    x[0, 0] = 0.0
    if shape[0] > 1:
        x[1] = 0.0  # a zero row: the minimum scale, zeros
    q, scale = per_token_quant_int8(x.to(DEVICE))
    want_q, want_scale = quantize_rows(x)
    assert q.dtype == torch.int8 and scale.shape == (shape[0], 1)
    torch.testing.assert_close(scale.cpu(), want_scale, rtol=0, atol=0)
    assert torch.equal(q.cpu(), want_q)


def test_ties_round_to_even():  # type: ignore[no-untyped-def]
    x = torch.tensor([[127.0, 0.5, 1.5, 2.5, -0.5, -1.5, 3.49, -126.5]])  # scale exactly 1
    q, scale = per_token_quant_int8(x.to(DEVICE))
    assert scale.item() == 1.0
    assert q.cpu().tolist() == [[127, 0, 2, 2, 0, -2, 3, -126]]
    assert torch.equal(q.cpu(), quantize_rows(x)[0])


@pytest.mark.parametrize("rows,n,k", [(1, 64, 64), (3, 100, 300), (17, 33, 1000), (32, 96, 4096), (48, 40, 520), (64, 72, 1000)])
def test_rows_kernel_sums_int8_exactly(rows, n, k):  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(rows + n)
    xq = torch.randint(-127, 128, (rows, k), generator=g, dtype=torch.int8)
    wq = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    xs = torch.rand(rows, 1, generator=g) + 0.01
    ws = torch.rand(1, n, generator=g) + 0.01
    exact = (xq.long() @ wq.long().t()).double() * xs.double() * ws.double()
    args = [t.to(DEVICE) for t in (xq, xs, wq, ws)]
    out = fp8_gemm_rows(*args, out_dtype=torch.float32).cpu()
    torch.testing.assert_close(out.double(), exact, rtol=1e-6, atol=1e-6 * exact.abs().max().item())


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.float16], ids=str)
def test_the_epilogue_scales_int32_sums(out_dtype):  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(0)
    acc = torch.randint(-(2**24), 2**24, (37, 1500), generator=g, dtype=torch.int32)
    xs = torch.rand(37, 1, generator=g) * 1e-3
    ws = torch.rand(1, 1500, generator=g) * 1e-3
    out = scale_product(acc.to(DEVICE), xs.to(DEVICE), ws.to(DEVICE), out_dtype).cpu()
    assert out.dtype == out_dtype
    want = (acc.double() * xs.double() * ws.double()).to(out_dtype)
    torch.testing.assert_close(out, want, rtol=2e-6 if out_dtype == torch.float32 else 1e-3, atol=0)
    with pytest.raises(ValueError, match="int32"):
        scale_product(acc.float().to(DEVICE), xs.to(DEVICE), ws.to(DEVICE), out_dtype)
