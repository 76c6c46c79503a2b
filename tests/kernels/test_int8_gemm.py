"""The many-rows INT8 product (mmserve/kernels/int8_gemm.py) against int64 sums scaled in float32:
odd sizes (rows past a tile, N not a multiple of a tile, K ending in a partial step), the
default tiling and small tiles whose grouped launch order covers several row and column
tiles, float32 and float16 outputs."""

import pytest
import torch

from mmserve.kernels.int8_gemm import Int8Tiling, choose_tiling, int8_gemm
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
