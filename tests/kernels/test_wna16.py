"""The weight-only int4/int8 product (mmserve/kernels/wna16.py) against x @ W^T with W built from the
unpacked values directly, W[n, k] = (q[k, n] - z[g, n]) * s[g, n]: odd sizes (rows 1-300, K
ending in a partial group, N not a multiple of the tile), 4 and 8 bits, fp32 and fp16."""

import pytest
import torch

from mmserve.kernels.wna16 import (
    choose_tiling,
    dequantize_packed,
    pack_columns,
    uses_dp4a,
    wna16_dequantize,
    wna16_gemm,
    wna16_product_ref,
)
from tests.kernels.conftest import DEVICE, FLOAT_DTYPES

CASES = [  # rows, N, K, bits, group_size
    (1, 96, 64, 4, 32),
    (3, 100, 80, 4, 32),  # K = 80: the last group has 16 channels
    (16, 64, 256, 8, 64),
    (17, 72, 128, 4, 128),
    (40, 48, 96, 8, 96),
    (300, 40, 64, 4, 16),
    (1, 64, 512, 4, 128),  # 128-channel steps, one row of scales each
    (5, 33, 384, 8, 128),
    (2, 48, 320, 4, 320),  # per channel (one group): 64-channel steps
    (33, 56, 200, 4, 200),  # a group no step size divides: scales per word
    (5, 40, 96, 4, 12),  # groups that split words: scales per value
    (2, 36, 120, 8, 6),
]


def _operands(rows: int, n: int, k: int, bits: int, group_size: int, dtype: torch.dtype):  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(rows * 7 + n)
    groups = -(-k // group_size)
    q = torch.randint(0, 1 << bits, (k, n), generator=g)
    zeros = torch.randint(0, 1 << bits, (groups, n), generator=g).to(dtype)
    scales = (torch.rand(groups, n, generator=g) * 0.02 + 0.001).to(dtype)
    x = torch.randn(rows, k, generator=g).to(dtype)
    w = (q.float() - zeros.float()[torch.arange(k) // group_size]) * scales.float()[torch.arange(k) // group_size]
    return x, q, zeros, scales, w.t()  # w: [N, K]


@pytest.mark.parametrize("dtype", [d for d in FLOAT_DTYPES if d != torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", CASES, ids=str)
def test_matches_the_dequantised_product(case, dtype):  # type: ignore[no-untyped-def]
    rows, n, k, bits, group_size = case
    x, q, zeros, scales, w = _operands(rows, n, k, bits, group_size, dtype)
    qweight = pack_columns(q, bits)
    torch.testing.assert_close(dequantize_packed(qweight, scales, zeros, bits, group_size), w, atol=0, rtol=0)
    args = [t.to(DEVICE) for t in (x, qweight, scales, zeros)]
    out = wna16_gemm(*args, bits, group_size)
    expected = x.float() @ w.t()
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    if uses_dp4a(x, bits, group_size):  # one 16-bit row in int8 activations: its arithmetic's reference
        expected, tol = wna16_product_ref(*args, bits, group_size).cpu(), 2e-3
    torch.testing.assert_close(out.float().cpu(), expected, rtol=tol, atol=tol * expected.abs().max().item())


@pytest.mark.parametrize("case", [(1, 96, 256, 4, 128), (20, 40, 96, 8, 32), (3, 64, 192, 4, 192), (7, 48, 72, 4, 24)], ids=str)
def test_symmetric_weights_need_no_zeros(case):  # type: ignore[no-untyped-def]
    """zeros None: every zero point is 2^(bits - 1), none read (a symmetric checkpoint)."""
    rows, n, k, bits, group_size = case
    x, q, _, scales, _ = _operands(rows, n, k, bits, group_size, torch.float32)
    qweight = pack_columns(q, bits)
    zeros = torch.full_like(scales, float(1 << (bits - 1)))
    w = dequantize_packed(qweight, scales, None, bits, group_size)
    torch.testing.assert_close(w, dequantize_packed(qweight, scales, zeros, bits, group_size), atol=0, rtol=0)
    out = wna16_gemm(x.to(DEVICE), qweight.to(DEVICE), scales.to(DEVICE), None, bits, group_size)
    expected = x @ w.t()
    torch.testing.assert_close(out.cpu(), expected, rtol=1e-4, atol=1e-4 * expected.abs().max().item())


@pytest.mark.parametrize("case", [CASES[2], CASES[4], CASES[10], CASES[11], (3, 200, 64, 4, 64)], ids=str)
@pytest.mark.parametrize("symmetric", [False, True], ids=["zeros", "symmetric"])
def test_dequantize_kernel_is_the_reference(case, symmetric):  # type: ignore[no-untyped-def]
    """The many-rows path's weight: dequantize_packed's values exactly (float32), also for a
    column slice of the operands."""
    _, n, _, bits, group_size = case
    _, q, zeros, scales, _ = _operands(*case, torch.float32)
    qweight = pack_columns(q, bits)
    zeros = None if symmetric else zeros
    want = dequantize_packed(qweight, scales, zeros, bits, group_size).t()
    args = [None if t is None else t.to(DEVICE) for t in (qweight, scales, zeros)]
    got = wna16_dequantize(*args, bits, group_size, torch.float32)
    assert torch.equal(got.cpu(), want)
    cut = slice(n // 3, n - 5)
    sliced = [None if t is None else t[:, cut] for t in args]
    assert torch.equal(wna16_dequantize(*sliced, bits, group_size, torch.float32).cpu(), want[:, cut])


def test_many_rows_dequantise_in_chunks(monkeypatch):  # type: ignore[no-untyped-def]
    """Over MAX_KERNEL_ROWS rows: chunks of columns dequantised and multiplied, concatenated;
    the kernel, forced by a tiling, gives the same product."""
    from mmserve.kernels import wna16

    monkeypatch.setattr(wna16, "CHUNK_ELEMENTS", 128 * 24)  # chunks of 24 columns
    rows, n, k, bits, group_size = 40, 100, 128, 4, 32
    x, q, zeros, scales, w = _operands(rows, n, k, bits, group_size, torch.float32)
    args = [t.to(DEVICE) for t in (x, pack_columns(q, bits), scales, zeros)]
    expected = x @ w.t()
    tol = {"rtol": 1e-4, "atol": 1e-4 * expected.abs().max().item()}
    torch.testing.assert_close(wna16_gemm(*args, bits, group_size).cpu(), expected, **tol)
    tiling = choose_tiling(rows, n, k, group_size, 132, bits)
    torch.testing.assert_close(wna16_gemm(*args, bits, group_size, tiling).cpu(), expected, **tol)


def test_rejects_bad_inputs():  # type: ignore[no-untyped-def]
    x, q, zeros, scales, _ = _operands(2, 64, 64, 4, 32, torch.float32)
    qweight = pack_columns(q, 4)
    args = [t.to(DEVICE) for t in (x, qweight, scales, zeros)]
    with pytest.raises(ValueError, match="bits must be 4 or 8"):
        wna16_gemm(*args, 3, 32)
    with pytest.raises(ValueError, match="scales and zeros must be"):
        wna16_gemm(*args, 4, 16)
    with pytest.raises(ValueError, match="rows of words for K"):
        wna16_gemm(args[0][:, :32], *args[1:], 4, 32)
    with pytest.raises(ValueError, match="not a multiple of 8"):
        pack_columns(q[:12], 4)


@pytest.mark.parametrize("case", [CASES[1], CASES[5], CASES[8]], ids=str)
def test_unsplit_products_match_too(case, monkeypatch):  # type: ignore[no-untyped-def]
    """With no programs wanted per SM, K is never split: the one-pass path, same results."""
    from mmserve.kernels import wna16

    monkeypatch.setattr(wna16, "PROGRAMS_PER_SM", 0)
    rows, n, k, bits, group_size = case
    assert wna16.choose_tiling(rows, n, k, group_size, 132).splits == 1
    x, q, zeros, scales, w = _operands(rows, n, k, bits, group_size, torch.float32)
    args = [t.to(DEVICE) for t in (x, pack_columns(q, bits), scales, zeros)]
    expected = x @ w.t()
    out = wna16_gemm(*args, bits, group_size).cpu()
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4 * expected.abs().max().item())


def test_decode_splits_k_into_whole_steps():  # type: ignore[no-untyped-def]
    from mmserve.kernels.wna16 import choose_tiling

    for n, k in [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]:  # Llama-3-8B
        t = choose_tiling(1, n, k, 128, num_sms=132)
        assert t.groups == 0 and t.block_k == 128 and t.k_per_split % t.block_k == 0
        assert (t.splits - 1) * t.k_per_split < k <= t.splits * t.k_per_split
        programs = -(-n // t.block_n) * t.splits
        assert programs >= 3 * 132 or t.splits == k // t.block_k  # SMs about filled, or K used up
    assert choose_tiling(4096, 4096, 4096, 128, num_sms=132).splits == 1  # a prefill's tiles suffice


def _tiled_product(case, dtype, symmetric, **tiling_options):  # type: ignore[no-untyped-def]
    """(the chosen tiling, the kernel's product as float32 on the CPU, x @ W^T in float32) for
    case with tiling_options; symmetric: no zero points (2^(bits - 1))."""
    rows, n, k, bits, group_size = case
    x, q, zeros, scales, w = _operands(rows, n, k, bits, group_size, dtype)
    qweight = pack_columns(q, bits)
    if symmetric:
        zeros = None
        w = dequantize_packed(qweight, scales, None, bits, group_size)
    tiling = choose_tiling(rows, n, k, group_size, 132, bits, **tiling_options)
    args = [None if t is None else t.to(DEVICE) for t in (x, qweight, scales, zeros)]
    out = wna16_gemm(*args, bits, group_size, tiling)
    return tiling, out.float().cpu(), x.float() @ w.t().float()


LOWP_CASES = [c for c in CASES if c[3] == 4 and (c[4] % 128 == 0 or c[4] >= c[2])]  # steps inside a group


@pytest.mark.parametrize("symmetric", [False, True], ids=["zeros", "symmetric"])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("case", LOWP_CASES + [(9, 64, 512, 4, 128)], ids=str)
def test_lowp_products_match_the_dequantised_product(case, dtype, symmetric):  # type: ignore[no-untyped-def]
    """4-bit steps inside a group dequantised in x's 16-bit dtype, the weights the product's M
    side (on CUDA the values two at a time by PTX; float32 x takes the float32 path): the
    weights are the float32 path's to the bit, so only the sums' order differs."""
    tiling, out, expected = _tiled_product(case, dtype, symmetric, lowp=True)
    assert tiling.groups == 0 and tiling.lowp and tiling.block_m == next(m for m in (8, 16, 32, 64) if case[0] <= m)
    tol = {torch.float32: 1e-4, torch.float16: 4e-3, torch.bfloat16: 2e-2}[dtype]
    torch.testing.assert_close(out, expected, rtol=tol, atol=tol * expected.abs().max().item())


def test_lowp_needs_4_bits_inside_a_group(monkeypatch):  # type: ignore[no-untyped-def]
    from mmserve.kernels import wna16

    with pytest.raises(ValueError, match="lowp products need 4 bits"):
        choose_tiling(1, 64, 256, 128, 132, bits=8, lowp=True)
    with pytest.raises(ValueError, match="lowp products need 4 bits"):
        choose_tiling(5, 40, 96, 12, 132, lowp=True)
    with pytest.raises(ValueError, match="lowp needed"):
        choose_tiling(1, 64, 256, 128, 132, lowp=False, pairs=1)
    x, q, _, scales, _ = _operands(1, 64, 256, 4, 128, torch.float16)
    tiling = choose_tiling(1, 64, 256, 128, 132, lowp=True, pairs=1)  # (bf16's PTX, on CUDA only)
    with pytest.raises(ValueError, match="needs CUDA and bf16"):
        wna16_gemm(x.to(DEVICE), pack_columns(q, 4).to(DEVICE), scales.to(DEVICE), None, 4, 128, tiling)
    monkeypatch.setattr(wna16, "LOWP", True)
    assert choose_tiling(1, 64, 512, 128, 132).lowp
    assert not choose_tiling(wna16.LOWP_MAX_ROWS + 1, 64, 512, 128, 132).lowp  # (slower there)
    assert not choose_tiling(1, 64, 512, 128, 132, bits=8).lowp
    assert not choose_tiling(5, 40, 96, 12, 132).lowp


@pytest.mark.parametrize("dtype", [d for d in FLOAT_DTYPES if d != torch.bfloat16], ids=str)
@pytest.mark.parametrize("symmetric", [False, True])
@pytest.mark.parametrize("case", [(72, 416, 32), (72, 416, 128), (100, 320, 320), (64, 1024, 128)], ids=str)
@pytest.mark.parametrize("loop", ["fused", "narrow", "q8-first"])
def test_one_row_in_int8_activations(case, symmetric, dtype, loop, monkeypatch):  # type: ignore[no-untyped-def]
    """One row with the activations in int8 (dp4a=True), 4 bits: groups of 32, of 128 (K = 416:
    a partial last step and group), per channel; N not a multiple of the tile; K split (1024) and
    not. Against the torch reference of its arithmetic (wna16_dp4a_ref) tightly, with a group of
    zeros and an outlier in another; on plain activations within their int8 rounding of the
    exact product. loop: quantised inside the one-row kernel (in tiles of DP4A_BLOCK_N channels
    or, narrow, half as many, as an output of fewer tiles than SMs takes them: DP4A_NARROW), or
    first by a kernel of their own (DP4A_FUSED_ONE_ROW off)."""
    from mmserve.kernels import wna16

    monkeypatch.setattr(wna16, "DP4A_FUSED_ONE_ROW", loop != "q8-first")
    monkeypatch.setattr(wna16, "DP4A_NARROW", loop == "narrow")
    n, k, group_size = case
    x, q, zeros, scales, _ = _operands(1, n, k, 4, group_size, dtype)
    x[0, 32:64], x[0, 100] = 0.0, 30.0
    qweight = pack_columns(q, 4)
    z = None if symmetric else zeros
    args = [t.to(DEVICE) if t is not None else None for t in (x, qweight, scales, z)]
    out = wna16_gemm(*args, 4, group_size, dp4a=True)
    assert out.shape == (1, n) and out.dtype == dtype
    expected = wna16.wna16_dp4a_ref(*args, 4, group_size).cpu()
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(out.float().cpu(), expected, rtol=tol, atol=tol * expected.abs().max().item())
    plain = torch.randn(1, k, generator=torch.Generator().manual_seed(n)).to(dtype)  # (no outlier)
    out = wna16_gemm(plain.to(DEVICE), *args[1:], 4, group_size, dp4a=True).float().cpu()
    exact = plain.float() @ dequantize_packed(qweight, scales, z, 4, group_size).t()
    assert ((out - exact).norm() / exact.norm()).item() < 2e-2
    monkeypatch.setattr(wna16, "DP4A", True)  # the default path takes it for DP4A_MAX_ROWS 16-bit rows
    assert wna16.uses_dp4a(args[0], 4, group_size) == (dtype != torch.float32)
    assert not wna16.uses_dp4a(args[0], 8, group_size) and not wna16.uses_dp4a(args[0], 4, 48)
    assert not wna16.uses_dp4a(torch.zeros(wna16.DP4A_MAX_ROWS + 1, k, dtype=dtype), 4, group_size)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("case", [(3, 72, 416, 32, False), (2, 100, 1024, 128, True), (5, 64, 320, 320, False)], ids=str)
def test_a_few_rows_in_int8_activations(case, dtype):  # type: ignore[no-untyped-def]
    """dp4a=True with several rows (quantised first, a step's words unpacked once for every
    row): the torch reference of its arithmetic, and each row as its own one-row product (but
    for the order of float32 sums); K split (1024) and not, a partial last step, per channel,
    symmetric."""
    from mmserve.kernels import wna16

    rows, n, k, group_size, symmetric = case
    x, q, zeros, scales, _ = _operands(rows, n, k, 4, group_size, dtype)
    x[-1, 40:72] = 0.0  # a group of zeros
    args = [t.to(DEVICE) if t is not None else None for t in (x, pack_columns(q, 4), scales, None if symmetric else zeros)]
    out = wna16_gemm(*args, 4, group_size, dp4a=True)
    assert out.shape == (rows, n) and out.dtype == dtype
    expected = wna16.wna16_dp4a_ref(*args, 4, group_size).cpu()
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]  # (the output's rounding)
    torch.testing.assert_close(out.float().cpu(), expected, rtol=tol, atol=tol * expected.abs().max().item())
    for r in range(rows):
        one = wna16_gemm(args[0][r : r + 1], *args[1:], 4, group_size, dp4a=True).float().cpu()
        torch.testing.assert_close(out[r : r + 1].float().cpu(), one, rtol=tol, atol=tol * one.abs().max().item())
    with pytest.raises(ValueError, match="dp4a takes up to"):
        wna16_gemm(torch.zeros(wna16.DP4A_ROWS + 1, k, dtype=dtype, device=DEVICE), *args[1:], 4, group_size, dp4a=True)


@pytest.mark.parametrize("steps", [1, 2, 3, 4])
@pytest.mark.parametrize("case", [(72, 416), (100, 1024), (40, 96)], ids=str)
def test_one_row_prefetch_changes_nothing(case, steps, monkeypatch):  # type: ignore[no-untyped-def]
    """wna16.DP4A_PREFETCH_STEPS: the one-row kernel's first steps asked of L2 before its wait.
    Under the interpreter each prefetched line is loaded, so an address past the weight (a
    partial last step, N not a multiple of the tile, a split slice's end, more steps asked
    than a slice has) fails here; the output equals the one without it, to the bit."""
    from mmserve.kernels import wna16

    n, k = case
    x, q, _, scales, _ = _operands(1, n, k, 4, 32, torch.float16)
    args = [t.to(DEVICE) for t in (x, pack_columns(q, 4), scales)]
    plain = wna16_gemm(*args, None, 4, 32, dp4a=True)
    monkeypatch.setattr(wna16, "DP4A_PREFETCH_STEPS", steps)
    assert torch.equal(wna16_gemm(*args, None, 4, 32, dp4a=True), plain)
    monkeypatch.setattr(wna16, "DP4A_PROGRAMS_PER_SM", 0)  # one slice of all of K, no split
    whole = wna16_gemm(*args, None, 4, 32, dp4a=True)
    monkeypatch.setattr(wna16, "DP4A_PREFETCH_STEPS", 0)
    assert torch.equal(whole, wna16_gemm(*args, None, 4, 32, dp4a=True))
