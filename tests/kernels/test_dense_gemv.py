"""The one-row dense product (mmserve/kernels/dense_gemv.py) against torch's x.float() @ W.float().T:
odd sizes (N not a multiple of the tile, K not a multiple of the step), K split or not, the
split's partials summed by the last program or by sum_splits, fp32 and fp16 (bf16 on CUDA)."""

import pytest
import torch

from mmserve.kernels import _common
from mmserve.kernels.dense_gemv import GemvTiling, dense_gemv
from tests.kernels.conftest import DEVICE

CASES = [  # N, K, tiling
    (64, 512, GemvTiling()),
    (50, 300, GemvTiling()),  # masks on both sides
    (7, 2000, GemvTiling(block_n=4, block_k=128, num_warps=1)),  # a few channels, K split
    (96, 1024, GemvTiling(block_n=16, block_k=256, num_warps=2, programs_per_sm=0)),  # no split
    (33, 640, GemvTiling(block_n=2, block_k=128, num_warps=1, num_stages=2)),
    (40, 96, GemvTiling(block_n=8, block_k=2048)),  # a step cut to K's next power of two
]


def _rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y.float() - ref).abs().max() / ref.abs().max()).item()


@pytest.mark.parametrize("n,k,tiling", CASES)
@pytest.mark.parametrize("serial", [True, False])
def test_dense_gemv_matches_torch(n: int, k: int, tiling: GemvTiling, serial: bool, dtype: torch.dtype,
                                  monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    monkeypatch.setattr(_common, "SERIAL_SPLITS", serial)
    x = torch.randn(1, k, device=DEVICE).to(dtype)
    w = (torch.randn(n, k, device=DEVICE) * 0.05).to(dtype)
    bias = torch.randn(n, device=DEVICE).to(dtype)
    y = dense_gemv(x, w, bias, tiling=tiling)
    ref = x.float() @ w.float().T + bias.float()
    assert y.shape == (1, n) and y.dtype == dtype
    # the float32 sums' order differs from torch's; fp16/bf16: the output's own rounding
    limit = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 8e-3}[dtype]
    assert _rel_err(y, ref) < limit


def test_dense_gemv_writes_out_and_every_channel() -> None:
    n, k = 300, 768
    x = torch.randn(k, device=DEVICE)
    w = torch.randn(n, k, device=DEVICE)
    out = torch.full((1, n), float("nan"), device=DEVICE)
    assert dense_gemv(x, w, out=out) is out  # (no bias)
    torch.testing.assert_close(out, (x @ w.T)[None], atol=1e-4, rtol=1e-5)


def test_dense_gemv_splits_k_for_a_small_product() -> None:
    """A 64-channel product at the default tiling has 8 tiles for 132 SMs: K is cut into slices
    (every slice's weights must count: a weight changed in the last slice changes the output)."""
    n, k = 64, 4096
    x = torch.randn(1, k, device=DEVICE)
    w = torch.randn(n, k, device=DEVICE)
    before = dense_gemv(x, w).clone()
    w[:, -1] += 1.0
    after = dense_gemv(x, w)
    torch.testing.assert_close(after - before, x[:, -1:].expand(1, n), atol=1e-3, rtol=1e-4)


@pytest.mark.parametrize(
    "x_shape,w_shape,msg",
    [((1, 64), (32, 65), "columns"), ((9, 64), (32, 64), "1-8 rows"), ((2, 3, 64), (32, 64), "1-8 rows")],
)
def test_dense_gemv_rejects_bad_shapes(x_shape: tuple[int, ...], w_shape: tuple[int, ...], msg: str) -> None:
    with pytest.raises(ValueError, match=msg):
        dense_gemv(torch.randn(*x_shape, device=DEVICE), torch.randn(*w_shape, device=DEVICE))


def test_dense_gemv_rejects_mixed_dtypes_and_strided_weights() -> None:
    x = torch.randn(1, 64, device=DEVICE)
    with pytest.raises(ValueError, match="one dtype"):
        dense_gemv(x, torch.randn(32, 64, device=DEVICE, dtype=torch.float16))
    with pytest.raises(ValueError, match="contiguous"):
        dense_gemv(x, torch.randn(64, 32, device=DEVICE).T)


def test_dense_gemv_rejects_a_bias_of_another_size() -> None:
    with pytest.raises(ValueError, match="bias"):
        dense_gemv(torch.randn(1, 64, device=DEVICE), torch.randn(32, 64, device=DEVICE), torch.randn(31, device=DEVICE))


def test_few_rows_products_swap_plain_sixteen_bit_projections(monkeypatch: pytest.MonkeyPatch) -> None:
    """few_rows_products swaps plain 16-bit nn.Linear modules (not float32 ones, not subclasses);
    a swapped module's one-row products run on dense_gemv, bias included, and more rows on
    F.linear, each equal to the module before the swap."""
    from torch import nn

    from mmserve.kernels import dense_gemv as gemv_module
    from mmserve.models.layers import FewRowsLinear, few_rows_products

    class Other(nn.Linear):
        pass

    model = nn.Sequential(nn.Linear(96, 80), nn.Linear(80, 40, bias=False), Other(40, 40), nn.Linear(40, 8)).to(DEVICE)
    for i in range(3):
        model[i].half()
    x = torch.randn(1, 96, device=DEVICE).half()
    rows = torch.randn(5, 96, device=DEVICE).half()
    before = [model[0](x).float(), model[0](rows).float(), model[1](model[0](x)).float()]
    assert few_rows_products(model) == 2
    assert [type(m) for m in model] == [FewRowsLinear, FewRowsLinear, Other, nn.Linear]
    calls = []
    real = gemv_module.dense_gemv
    monkeypatch.setattr(gemv_module, "dense_gemv", lambda *a, **k: calls.append(a[0].shape) or real(*a, **k))
    after = [model[0](x).float(), model[0](rows).float(), model[1](model[0](x)).float()]
    assert calls == [(1, 96), (1, 96), (1, 80)]  # the five-row product is F.linear's
    for a, b in zip(after, before, strict=True):
        torch.testing.assert_close(a, b, atol=2e-3, rtol=2e-3)


def _scaled_operands(n: int, k: int, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    from mmserve.kernels.quant import per_token_quant_ref, quantize_weight_fp8

    x = torch.randn(1, k, device=DEVICE) * 3.0
    w = torch.randn(n, k, device=DEVICE) * torch.logspace(-3, 0, n, device=DEVICE)[:, None]
    if dtype == torch.int8:
        from mmserve.models.int8 import quantize_rows

        (xq, xs), (wq, ws) = quantize_rows(x), quantize_rows(w)
    else:
        (xq, xs), (wq, ws) = per_token_quant_ref(x), quantize_weight_fp8(w)
    return xq, xs, wq, ws.view(1, -1)


@pytest.mark.parametrize("n,k,tiling", CASES)
@pytest.mark.parametrize("qdtype", [torch.float8_e4m3fn, torch.int8], ids=str)
def test_scaled_gemv_matches_the_fp8_reference(n: int, k: int, tiling: GemvTiling, qdtype: torch.dtype) -> None:
    """One row of FP8 / INT8 operands against fp8_gemm's torch reference ((xq wq^T) x_scale
    w_scale in float32; float8 products are exact in float32, int8 sums exact in int32), the
    bias added, in float32 and bfloat16 outputs."""
    from mmserve.kernels.dense_gemv import scaled_gemv
    from mmserve.kernels.fp8_gemm import fp8_gemm_rows_ref

    xq, xs, wq, ws = _scaled_operands(n, k, qdtype)
    bias = torch.randn(n, device=DEVICE)
    expected = fp8_gemm_rows_ref(xq, xs, wq, ws) + bias
    got = scaled_gemv(xq, xs, wq, ws, torch.float32, bias, tiling)
    assert got.shape == (1, n) and got.dtype == torch.float32
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())
    got16 = scaled_gemv(xq, xs, wq, ws, torch.float16, tiling=tiling)
    torch.testing.assert_close(got16.float(), expected - bias, rtol=2e-3, atol=2e-3 * expected.abs().max().item())


def test_scaled_gemv_rejects_bad_operands() -> None:
    from mmserve.kernels.dense_gemv import scaled_gemv

    xq, xs, wq, ws = _scaled_operands(32, 64, torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="float8_e4m3fn or int8"):
        scaled_gemv(xq.float(), xs, wq.float(), ws)
    with pytest.raises(ValueError, match="float8_e4m3fn or int8"):
        scaled_gemv(xq, xs, wq.view(torch.int8), ws)
    with pytest.raises(ValueError, match="w_scale"):
        scaled_gemv(xq, xs, wq, ws[:, :31])
    with pytest.raises(ValueError, match="x_scale"):
        scaled_gemv(xq, torch.ones(2, 1, device=DEVICE), wq, ws)


@pytest.mark.parametrize("qdtype", [torch.float8_e4m3fn, torch.int8], ids=["fp8", "int8"])
@pytest.mark.parametrize("rows", [1, 3])
def test_few_rows_product_takes_one_row_to_scaled_gemv(
    rows: int, qdtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """fp8_gemm.few_rows_product (Fp8Linear's and Int8Linear's products of a few rows), with
    ONE_ROW_GEMV on (the default): FP8's one row by scaled_gemv, more rows and INT8's by
    fp8_gemm_rows, each the reference's result."""
    from mmserve.kernels import dense_gemv as gemv_module
    from mmserve.kernels import fp8_gemm
    from mmserve.kernels.fp8_gemm import few_rows_product, fp8_gemm_rows_ref

    monkeypatch.setattr(fp8_gemm, "ONE_ROW_GEMV", True)
    xq, xs, wq, ws = _scaled_operands(48, 320, qdtype)
    xq, xs = xq.expand(rows, -1).contiguous(), xs.expand(rows, -1).contiguous()
    calls = []
    real = gemv_module.scaled_gemv
    monkeypatch.setattr(gemv_module, "scaled_gemv", lambda *a: calls.append(a[0].shape) or real(*a))
    got = few_rows_product(xq, xs, wq, ws, torch.float32)
    assert calls == ([(1, 320)] if rows == 1 and qdtype != torch.int8 else [])
    expected = fp8_gemm_rows_ref(xq, xs, wq, ws)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())


@pytest.mark.parametrize("rows", [2, 3, 8])
@pytest.mark.parametrize("n,k,tiling", [CASES[1], CASES[2], (96, 1024, None)])
def test_dense_gemv_few_rows(rows: int, n: int, k: int, tiling: GemvTiling | None, dtype: torch.dtype) -> None:
    """A few rows (each weight tile read once for all): every row the torch product's, bias
    included, rows padded to a power of two and masked; x's rows may be strided."""
    x = torch.randn(rows, 2 * k, device=DEVICE).to(dtype)[:, :k]  # rows apart by 2 K
    w = (torch.randn(n, k, device=DEVICE) * 0.05).to(dtype)
    bias = torch.randn(n, device=DEVICE).to(dtype)
    y = dense_gemv(x, w, bias, tiling=tiling)
    ref = x.float() @ w.float().T + bias.float()
    assert y.shape == (rows, n) and y.dtype == dtype
    limit = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 8e-3}[dtype]
    assert _rel_err(y, ref) < limit
    for r in range(rows):  # each row alone: its own product, not a neighbour's
        assert _rel_err(y[r : r + 1], ref[r : r + 1]) < limit
