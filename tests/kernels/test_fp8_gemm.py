"""The few-rows FP8 product (mmserve/kernels/fp8_gemm.py) against its torch reference: float8 operands
(loads and tensor-core products of float8 are exact under the interpreter too), odd sizes."""

import pytest
import torch

from mmserve.kernels.fp8_gemm import MAX_ROWS, fp8_gemm_rows, fp8_gemm_rows_ref
from mmserve.kernels.quant import FP8_DTYPE, per_token_quant_ref, quantize_weight_fp8
from tests.kernels.conftest import DEVICE

CASES = [
    (1, 96, 64),
    (3, 100, 300),
    (16, 64, 512),
    (7, 4096 + 32, 256 + 16),
    (24, 48, 160),
    (32, 32, 64),
    (48, 80, 200),  # 64-row tiles
    (64, 64, 640),
]


def _operands(rows: int, n: int, k: int) -> tuple[torch.Tensor, ...]:
    x = torch.randn(rows, k, device=DEVICE) * torch.logspace(-2, 2, rows, device=DEVICE)[:, None]
    w = torch.randn(n, k, device=DEVICE) * torch.logspace(-3, 0, n, device=DEVICE)[:, None]
    xq, xs = per_token_quant_ref(x)
    wq, ws = quantize_weight_fp8(w)
    return xq, xs, wq, ws.view(1, -1)


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("case", CASES, ids=str)
def test_matches_the_reference(case, out_dtype):  # type: ignore[no-untyped-def]
    """Rows in tiles of 16, 32 or 64 as they fit."""
    xq, xs, wq, ws = _operands(*case)
    out = fp8_gemm_rows(xq, xs, wq, ws, out_dtype)
    expected = fp8_gemm_rows_ref(xq, xs, wq, ws)
    assert out.shape == (case[0], case[1]) and out.dtype == out_dtype
    tol = 1e-5 if out_dtype == torch.float32 else 2e-3
    if DEVICE.type == "cuda" and case[0] > 32:  # wgmma's FP8 partial sums, promoted every 128
        tol = max(tol, 1e-3)
    torch.testing.assert_close(
        out.float(), expected, rtol=tol, atol=tol * expected.abs().max().item()
    )


@pytest.mark.parametrize("block_n", [16, 64])
def test_block_sizes_do_not_change_the_result(block_n):
    xq, xs, wq, ws = _operands(4, 200, 384)
    base = fp8_gemm_rows(xq, xs, wq, ws, torch.float32)
    torch.testing.assert_close(
        fp8_gemm_rows(xq, xs, wq, ws, torch.float32, block_n=block_n, block_k=128), base
    )


def test_rejects_bad_operands():
    xq, xs, wq, ws = _operands(2, 32, 64)
    with pytest.raises(ValueError, match=f"at most {MAX_ROWS}"):
        fp8_gemm_rows(
            torch.zeros(MAX_ROWS + 1, 64, dtype=FP8_DTYPE, device=DEVICE),
            torch.ones(17, 1, device=DEVICE),
            wq,
            ws,
        )
    with pytest.raises(ValueError, match="share K"):
        fp8_gemm_rows(xq[:, :32], xs, wq, ws)
    with pytest.raises(ValueError, match="w_scale"):
        fp8_gemm_rows(xq, xs, wq, ws[:, :8])
    with pytest.raises(ValueError, match="share a dtype"):
        fp8_gemm_rows(xq.float(), xs, wq, ws)


@pytest.mark.parametrize("case", [(1, 96, 2048), (5, 40, 1000), (32, 64, 700)], ids=str)
@pytest.mark.parametrize("splits", [2, 3, 64])
def test_split_k_sums_the_slices(case, splits):  # type: ignore[no-untyped-def]
    """K split into slices of whole tiles (more slices than tiles: one a tile), their sums
    added in order and scaled: the unsplit result within float rounding; int8's exactly."""
    xq, xs, wq, ws = _operands(*case)
    expected = fp8_gemm_rows_ref(xq, xs, wq, ws)
    out = fp8_gemm_rows(xq, xs, wq, ws, torch.float32, block_k=128, splits=splits)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())
    rows, n, k = case
    gen = torch.Generator().manual_seed(k)
    iq = torch.randint(-127, 128, (rows, k), generator=gen, dtype=torch.int8).to(DEVICE)
    iw = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8).to(DEVICE)
    unsplit = fp8_gemm_rows(iq, xs, iw, ws, torch.float32, block_k=128, splits=1)
    assert torch.equal(fp8_gemm_rows(iq, xs, iw, ws, torch.float32, block_k=128, splits=splits), unsplit)
    with pytest.raises(ValueError, match="splits must be >= 1"):
        fp8_gemm_rows(xq, xs, wq, ws, splits=0)


@pytest.mark.parametrize("steps", [1, 2, 3])
@pytest.mark.parametrize("case", [(1, 96, 2048), (5, 40, 1000), (3, 100, 300)], ids=str)
def test_prefetch_changes_nothing(case, steps, monkeypatch):  # type: ignore[no-untyped-def]
    """fp8_gemm.PREFETCH_STEPS: each program's first weight steps asked of L2 before its wait.
    Under the interpreter each line's offset is checked (one past the weight makes the output
    NaN): K not a multiple of the tile, N not of the channels, split slices and not, more steps
    asked than a slice has. The output equals the one without it, to the bit."""
    from mmserve.kernels import fp8_gemm

    xq, xs, wq, ws = _operands(*case)
    for splits in (1, 2, 3):
        monkeypatch.setattr(fp8_gemm, "PREFETCH_STEPS", 0)
        plain = fp8_gemm_rows(xq, xs, wq, ws, torch.float32, block_k=256, splits=splits)
        monkeypatch.setattr(fp8_gemm, "PREFETCH_STEPS", steps)
        assert torch.equal(fp8_gemm_rows(xq, xs, wq, ws, torch.float32, block_k=256, splits=splits), plain)
