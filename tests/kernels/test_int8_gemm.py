"""The many-rows INT8 product (kernels/int8_gemm.py) against int64 sums scaled in float32:
odd sizes (rows past a tile, N not a multiple of a tile, K ending in a partial step), the
default tiling and small tiles whose grouped launch order covers several row and column
tiles, float32 and float16 outputs."""

import pytest
import torch

from mmserve.kernels.int8_gemm import Int8Tiling, choose_tiling, fp8_gemm_tiled, int8_gemm
from tests.kernels.conftest import DEVICE

SMALL = Int8Tiling(block_m=16, block_n=32, block_k=32, group_m=2, num_warps=4, num_stages=2)


def _operands(rows: int, n: int, k: int):  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(rows * 31 + n + k)
    xq = torch.randint(-127, 128, (rows, k), generator=g, dtype=torch.int8)
    wq = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    x_scale = torch.rand(rows, 1, generator=g) * 0.01 + 1e-4
    w_scale = torch.rand(1, n, generator=g) * 0.01 + 1e-4
    return xq, x_scale, wq, w_scale


def _expected(xq, x_scale, wq, w_scale):  # type: ignore[no-untyped-def]
    acc = xq.long() @ wq.long().t()  # exact; |acc| < 2^24 here, so exact in float32 too
    return acc.float() * x_scale * w_scale


@pytest.mark.parametrize("rows,n,k", [(33, 40, 64), (130, 72, 200), (300, 100, 1000), (64, 256, 96)])
@pytest.mark.parametrize("tiling", [None, SMALL], ids=["default", "small"])
def test_the_product_is_exact_sums_scaled(rows, n, k, tiling):  # type: ignore[no-untyped-def]
    operands = _operands(rows, n, k)
    out = int8_gemm(*(t.to(DEVICE) for t in operands), out_dtype=torch.float32, tiling=tiling)
    torch.testing.assert_close(out.cpu(), _expected(*operands), rtol=1e-6, atol=0)


def test_half_output():  # type: ignore[no-untyped-def]
    operands = _operands(40, 48, 128)
    out = int8_gemm(*(t.to(DEVICE) for t in operands), out_dtype=torch.float16, tiling=SMALL)
    assert out.dtype == torch.float16
    torch.testing.assert_close(out.float().cpu(), _expected(*operands), rtol=1e-3, atol=1e-3)


def test_tilings_and_bad_inputs():  # type: ignore[no-untyped-def]
    assert choose_tiling(64).block_m == 64 and choose_tiling(4096).block_m == 128
    xq, x_scale, wq, w_scale = (t.to(DEVICE) for t in _operands(4, 8, 32))
    with pytest.raises(ValueError, match="must share K"):
        int8_gemm(xq[:, :16], x_scale, wq, w_scale)
    with pytest.raises(ValueError, match="must be int8"):
        int8_gemm(xq.float(), x_scale, wq, w_scale)
    with pytest.raises(ValueError, match="x_scale"):
        int8_gemm(xq, x_scale[:2], wq, w_scale)
    assert int8_gemm(xq[:0], x_scale[:0], wq, w_scale).shape == (0, 8)


# FP8 (fp8_gemm_tiled): integers in [-3, 3], exact in float8_e4m3fn, so every partial sum is
# exact even in the GPU's narrower FP8 accumulator and the sums are exact in float32
def _fp8_operands(rows: int, n: int, k: int, dtype: torch.dtype):  # type: ignore[no-untyped-def]
    xq, x_scale, wq, w_scale = _operands(rows, n, k)
    return (xq % 7 - 3).to(dtype), x_scale, (wq % 7 - 3).to(dtype), w_scale


@pytest.mark.parametrize("rows,n,k", [(33, 40, 64), (130, 72, 200), (300, 100, 1000)])
@pytest.mark.parametrize("tiling", [None, SMALL], ids=["default", "small"])
def test_the_fp8_product_is_the_sums_scaled(rows, n, k, tiling):  # type: ignore[no-untyped-def]
    """(float16 operands under the interpreter, whose FP8 rounding is wrong; float8_e4m3fn on
    the GPU, where the partial sums are promoted to float32 every K step)"""
    dtype = torch.float8_e4m3fn if DEVICE.type == "cuda" else torch.float16
    operands = _fp8_operands(rows, n, k, dtype)
    out = fp8_gemm_tiled(*(t.to(DEVICE) for t in operands), out_dtype=torch.float32, tiling=tiling)
    xq, x_scale, wq, w_scale = operands
    expected = (xq.float() @ wq.float().t()) * x_scale * w_scale  # |sums| < 2^24: exact
    torch.testing.assert_close(out.cpu(), expected, rtol=1e-6, atol=0)


def test_fp8_operands_are_checked():  # type: ignore[no-untyped-def]
    xq, x_scale, wq, w_scale = (t.to(DEVICE) for t in _operands(4, 8, 32))
    with pytest.raises(ValueError, match="must both be float8_e4m3fn"):
        fp8_gemm_tiled(xq, x_scale, wq, w_scale)  # int8
    with pytest.raises(ValueError, match="must both be float8_e4m3fn"):
        fp8_gemm_tiled(xq.half(), x_scale, wq.float(), w_scale)


@pytest.mark.skipif(DEVICE.type != "cuda", reason="the GPU's FP8 accumulator")
def test_fp8_partial_sums_are_promoted_on_the_gpu():  # type: ignore[no-untyped-def]
    """4,096 products of 9 sum to 36,864: past 2^14 an accumulator of about 14 bits (Hopper's
    FP8 tensor cores without promotion) loses the odd units; promoted to float32 every K step
    of 128 (at most 1,152 each) the sum is exact."""
    ones = torch.full((64, 4096), 3.0, device="cuda").to(torch.float8_e4m3fn)
    scale = torch.ones(64, 1, device="cuda")
    out = fp8_gemm_tiled(ones, scale, ones, scale.view(1, -1), out_dtype=torch.float32)
    assert torch.equal(out, torch.full_like(out, 36864.0))
