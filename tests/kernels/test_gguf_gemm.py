"""The GGUF block kernels (mmserve/kernels/gguf_blocks.py, mmserve/kernels/gguf_gemm.py) against the gguf
package's own dequantiser, for every supported type: random blocks (quantised by gguf where
it can quantise the type, random valid bytes for the K-quants, which it only dequantises),
rows 1-300, partial tiles of rows and of K, float32 / float16 (bfloat16 too on CUDA)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mmserve.kernels import gguf_gemm
from mmserve.kernels._common import q8_round_trip
from mmserve.kernels.gguf_blocks import FORMATS, gguf_dequantize, gguf_dequantize_ref
from mmserve.kernels.gguf_gemm import MAX_ROWS, gguf_gemm_rows, gguf_matmul, gguf_matmul_ref
from mmserve.models.gguf_linear import GgufLinear
from tests.kernels.conftest import DEVICE

TYPES = list(FORMATS)
# K per type family: 7 blocks of 32 (a partial step: the kernels read 8 at a time), and 2
# super-blocks of 256
K = {"legacy": 224, "k_quant": 512}


def random_blocks(qtype: str, n: int, k: int, seed: int = 0) -> torch.Tensor:
    """uint8 [n, k // elements, bytes]: gguf's quantisation of random weights, or, for the
    K-quants (gguf cannot quantise them), random bytes with finite float16 scales."""
    import gguf
    from gguf.quants import quantize

    fmt, rng = FORMATS[qtype], np.random.default_rng(seed)
    shape = (n, k // fmt.elements, fmt.bytes)
    if fmt.elements == 32:
        weights = rng.standard_normal((n, k)).astype(np.float32)
        raw = quantize(weights, gguf.GGMLQuantizationType[qtype]).reshape(shape)
    else:
        raw = rng.integers(0, 256, shape, dtype=np.uint8)
        scales = (rng.standard_normal((*shape[:2], 2)) * 5e-3).astype(np.float16).view(np.uint8)
        if qtype == "Q6_K":
            raw[:, :, 208:210] = scales[:, :, :2]  # d is last
        else:
            raw[:, :, 0:4] = scales  # d, dmin
    return torch.from_numpy(np.ascontiguousarray(raw)).to(DEVICE)


def _k(qtype: str) -> int:
    return K["k_quant" if qtype.endswith("_K") else "legacy"]


def _assert_close(out: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]
    scale = expected.abs().max().item()
    torch.testing.assert_close(out.float(), expected, rtol=tol, atol=tol * scale)


@pytest.mark.parametrize("qtype", TYPES)
def test_dequantize_is_ggufs(qtype: str, dtype: torch.dtype) -> None:
    blocks = random_blocks(qtype, 37, _k(qtype))
    out = gguf_dequantize(blocks, qtype, dtype)
    expected = gguf_dequantize_ref(blocks, qtype)
    assert out.shape == (37, _k(qtype)) and out.dtype == dtype
    # ggml's float32 arithmetic (on a GPU a multiply-add may be fused: one rounding fewer)
    _assert_close(out, expected, dtype)


@pytest.mark.parametrize("rows", [1, 5, 16, 17, 300])
@pytest.mark.parametrize("qtype", TYPES)
def test_matmul_is_x_times_ggufs_weight(qtype: str, rows: int, dtype: torch.dtype) -> None:
    """Up to MAX_ROWS rows the few-rows kernel; more, the dequantise-then-matmul path. 41
    output channels: a partial tile."""
    k = _k(qtype)
    blocks = random_blocks(qtype, 41, k, seed=rows)
    x = torch.randn(rows, k, device=DEVICE).to(dtype)
    out = gguf_matmul(x, blocks, qtype)
    assert out.shape == (rows, 41) and out.dtype == dtype
    _assert_close(out, gguf_gemm.gguf_product_ref(x, blocks, qtype), dtype)  # (one 16-bit row: int8 x, DP4A)


@pytest.mark.parametrize("qtype", ["Q5_0", "Q4_K", "Q6_K"])
@pytest.mark.parametrize("block_n", [16, 64])
def test_tile_sizes_do_not_change_the_product(qtype: str, block_n: int) -> None:
    blocks = random_blocks(qtype, 50, _k(qtype))
    x = torch.randn(3, _k(qtype), device=DEVICE)
    out = gguf_gemm_rows(x, blocks, qtype, block_n=block_n)
    _assert_close(out, gguf_matmul_ref(x, blocks, qtype), torch.float32)


@pytest.mark.parametrize("qtype", ["Q4_0", "Q8_0", "Q4_K", "Q6_K"])
@pytest.mark.parametrize("programs_per_sm", [0, 1, 4])
def test_split_k_does_not_change_the_product(qtype: str, programs_per_sm: int) -> None:
    """K split into slices of whole 256-element steps (0: none; 4: a slice a step here; the
    32-element types end in a partial step), partial sums added in order: the unsplit product
    within float rounding."""
    k = 4 * _k(qtype) + (96 if qtype in ("Q4_0", "Q8_0") else 0)
    blocks = random_blocks(qtype, 40, k, seed=programs_per_sm)
    x = torch.randn(2, k, device=DEVICE)
    out = gguf_gemm_rows(x, blocks, qtype, programs_per_sm=programs_per_sm)
    _assert_close(out, gguf_matmul_ref(x, blocks, qtype), torch.float32)


@pytest.mark.parametrize("factored", [True, False])
@pytest.mark.parametrize("qtype", ["Q4_K", "Q5_K"])
@pytest.mark.parametrize("rows", [1, 7, 16])
def test_kquant_products_by_weight_and_by_sub_block_sum(
    qtype: str, rows: int, factored: bool, dtype: torch.dtype
) -> None:
    """Q4_K / Q5_K's two forms of the product: every weight dequantised, then multiplied
    (step_part), and the quants multiplied, then scaled a sub-block at a time (q45k_chunk).
    Both are x times gguf's weights; 3 super-blocks, 45 channels (a partial tile). (16-bit x
    takes LOWP by default: lowp=False keeps these float32 forms.)"""
    blocks = random_blocks(qtype, 45, 768, seed=rows)
    x = torch.randn(rows, 768, device=DEVICE).to(dtype)
    out = gguf_gemm_rows(x, blocks, qtype, factored=factored, lowp=False, dp4a=False)
    _assert_close(out, gguf_matmul_ref(x, blocks, qtype), dtype)


@pytest.mark.parametrize("words", [False, True])
@pytest.mark.parametrize("qtype", ["Q4_K", "Q5_K", "Q6_K"])
def test_dequantize_in_the_16_bit_dtype(qtype: str, words: bool, dtype: torch.dtype) -> None:
    """gguf_dequantize(lowp=True): a K-quant dequantised in the output's 16-bit dtype (d1 and m1
    rounded to it first, then one multiply-add) is within two roundings of gguf's weights; float32
    keeps the float32 path. 37 rows (a partial tile of 64), 2 super-blocks."""
    blocks = random_blocks(qtype, 37, 512, seed=3)
    expected = gguf_dequantize_ref(blocks, qtype)
    out = gguf_dequantize(blocks, qtype, dtype, lowp=True, words=words)
    assert out.shape == (37, 512) and out.dtype == dtype
    unit = {torch.float32: 2**-24, torch.float16: 2**-11, torch.bfloat16: 2**-8}[dtype]
    scale = expected.abs().max().item()
    torch.testing.assert_close(out.float(), expected, rtol=4 * unit, atol=4 * unit * scale)


@pytest.mark.parametrize("programs_per_sm", [0, 4])
@pytest.mark.parametrize(("qtype", "words"), [("Q4_K", False), ("Q4_K", True), ("Q5_K", False), ("Q5_K", True), ("Q6_K", False)])
@pytest.mark.parametrize("rows", [1, 7, 16])
def test_kquants_dequantised_in_the_16_bit_dtype(
    qtype: str, words: bool, rows: int, programs_per_sm: int, dtype: torch.dtype,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    """lowp=True: the K-quants dequantised in x's own dtype (on CUDA in bfloat16 by bits, inline
    PTX; float32 keeps the float32 path) is x times gguf's weights; 3 super-blocks, 45
    channels (a partial tile), K unsplit and split, Q4_K's and Q5_K's scales read by bytes and by words."""
    monkeypatch.setattr(gguf_gemm, "LOWP_WORDS", words)
    blocks = random_blocks(qtype, 45, 768, seed=rows)
    x = torch.randn(rows, 768, device=DEVICE).to(dtype)
    expected = gguf_matmul_ref(x, blocks, qtype)
    for block_n in (16, 64):  # 16 channels a program: a product too small for a warpgroup MMA
        out = gguf_gemm_rows(x, blocks, qtype, block_n, programs_per_sm=programs_per_sm, lowp=True, dp4a=False)
        assert out.shape == (rows, 45) and out.dtype == dtype
        _assert_close(out, expected, dtype)


@pytest.mark.parametrize("qtype", ["Q4_1", "Q4_K", "Q6_K"])
@pytest.mark.parametrize("unroll", [2, 3])
def test_unrolled_steps_do_not_change_the_product(qtype: str, unroll: int) -> None:
    """Several steps an iteration (the bench's sweep): 5 steps, so the last iteration runs
    past the program's slice, and a split of K (programs_per_sm 4), whose slices end early."""
    k = 5 * 256
    blocks = random_blocks(qtype, 40, k, seed=unroll)
    x = torch.randn(3, k, device=DEVICE)
    for programs in (0, 4):
        out = gguf_gemm_rows(x, blocks, qtype, programs_per_sm=programs, unroll=unroll)
        _assert_close(out, gguf_matmul_ref(x, blocks, qtype), torch.float32)


@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("programs_per_sm", [0, 4])
def test_one_row_without_tensor_cores(qtype: str, programs_per_sm: int, dtype: torch.dtype) -> None:
    """The one-row kernel (gemv=True): every type, K unsplit and split, 41 channels (a partial
    tile), 3 steps for the K-quants and 7 blocks (a partial step) for the others."""
    k = 3 * 256 if qtype.endswith("_K") else _k(qtype)
    blocks = random_blocks(qtype, 41, k, seed=programs_per_sm)
    x = torch.randn(1, k, device=DEVICE).to(dtype)
    out = gguf_gemm_rows(x, blocks, qtype, programs_per_sm=programs_per_sm, gemv=True, dp4a=False)
    assert out.shape == (1, 41) and out.dtype == dtype
    _assert_close(out, gguf_matmul_ref(x, blocks, qtype), dtype)


def test_many_rows_in_chunks_of_the_weight() -> None:
    blocks = random_blocks("Q8_0", 70, 64)
    x = torch.randn(40, 64, device=DEVICE)
    chunked = gguf_matmul(x, blocks, "Q8_0", chunk_elements=64 * 16)  # 16 rows of W at a time
    _assert_close(chunked, gguf_matmul_ref(x, blocks, "Q8_0"), torch.float32)


@pytest.mark.parametrize("lowp", [False, True])
def test_gguf_linear_kernels_equal_its_reference(
    dtype: torch.dtype, lowp: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A merged projection of mixed types (Q4_K, Q6_K, then a float part) with a bias: the
    Triton path (few rows and many; the K-quants in float32 or, lowp, in x's dtype) equals
    the module's CPU path."""
    monkeypatch.setattr(gguf_gemm, "LOWP", lowp)
    k = 256
    parts = [random_blocks("Q4_K", 24, k, 1), random_blocks("Q6_K", 8, k, 2)]
    parts.append(torch.randn(8, k, device=DEVICE))
    linear = GgufLinear(k, 40, torch.randn(40, device=DEVICE).to(dtype), dtype, DEVICE)
    for i, (start, stop) in enumerate([(0, 24), (24, 32), (32, 40)]):
        linear.load_rows(parts[i], f"part{i}", slice(start, stop))
    linear.finish()
    for rows in (3, MAX_ROWS + 8):
        x = torch.randn(rows, k, device=DEVICE).to(dtype)
        expected = linear(x, use_kernels=False).float()
        _assert_close(linear(x, use_kernels=True), expected, dtype)


def test_rejects_bad_operands() -> None:
    blocks = random_blocks("Q4_0", 8, 64)
    x = torch.randn(2, 64, device=DEVICE)
    with pytest.raises(ValueError, match="qtype 'IQ2_XS' is not one of"):
        gguf_matmul(x, blocks, "IQ2_XS")
    with pytest.raises(ValueError, match="20 bytes per Q4_1 block"):
        gguf_matmul(x, blocks, "Q4_1")
    with pytest.raises(ValueError, match="K = 64"):
        gguf_matmul(x[:, :32], blocks, "Q4_0")
    with pytest.raises(ValueError, match=f"at most {MAX_ROWS}"):
        gguf_gemm_rows(torch.randn(MAX_ROWS + 1, 64, device=DEVICE), blocks, "Q4_0")
    with pytest.raises(ValueError, match="power of two"):
        gguf_gemm_rows(x, blocks, "Q4_0", block_n=48)
    with pytest.raises(ValueError, match="x must be float32"):
        gguf_matmul(x.long(), blocks, "Q4_0")
    with pytest.raises(ValueError, match="contiguous"):
        gguf_dequantize(blocks.transpose(0, 1), "Q4_0", torch.float32)


@pytest.mark.parametrize("qtype", gguf_gemm.DP4A_KERNEL_TYPES)
@pytest.mark.parametrize("programs_per_sm", [0, 4])
@pytest.mark.parametrize("prequant", [False, True])
def test_one_row_in_int8_activations(qtype: str, programs_per_sm: int, prequant: bool, dtype: torch.dtype) -> None:
    """The one-row kernel with the activations in int8 (dp4a=True), quantised inside it or by
    a kernel first (prequant): K unsplit and split, 41 channels (a partial tile), 3 steps; the arithmetic against a torch reference of it on gguf's
    weight, and the product against the exact one within the activations' int8 rounding. A
    group of zeros (scale 0) and a large outlier in another."""
    k = 3 * 256
    blocks = random_blocks(qtype, 41, k, seed=7 + programs_per_sm)
    x = torch.randn(1, k, device=DEVICE)
    x[0, 32:64], x[0, 300] = 0.0, 40.0
    x = x.to(dtype)
    out = gguf_gemm_rows(x, blocks, qtype, programs_per_sm=programs_per_sm, dp4a=True, prequant=prequant)
    assert out.shape == (1, 41) and out.dtype == dtype
    _assert_close(out, gguf_gemm.gguf_matmul_dp4a_ref(x, blocks, qtype), dtype)
    exact = gguf_matmul_ref(x, blocks, qtype)
    assert ((out.float() - exact).norm() / exact.norm()).item() < 2e-2


def test_int8_activations_round_as_ggml() -> None:
    """q8_round_trip (the reference of the kernel's rounding): by 32, half away from zero, to
    127 steps of max |x| / 127; a group of zeros stays zero."""
    x = torch.zeros(1, 64)
    x[0, :4] = torch.tensor([127.0, 0.5, -0.5, -1.49])
    out = q8_round_trip(x)
    assert out[0, :4].tolist() == [127.0, 1.0, -1.0, -1.0] and not out[0, 32:].any()


@pytest.mark.parametrize("qtype", ["Q4_K", "Q5_K"])
@pytest.mark.parametrize("rows", [2, 5])
@pytest.mark.parametrize("programs_per_sm", [0, 4])
@pytest.mark.parametrize("prequant", [None, False])
def test_a_few_rows_in_int8_activations(qtype: str, rows: int, programs_per_sm: int, prequant: bool | None, dtype: torch.dtype) -> None:  # fmt: skip
    """dp4a=True with several rows (a program a tile, its quants unpacked once for every row;
    the rows quantised first by default, or inside the product): each row as its own one-row
    product (but for the order of float32 sums), K split and not, 41 channels."""
    k = 3 * 256
    blocks = random_blocks(qtype, 41, k, seed=rows)
    x = torch.randn(rows, k, device=DEVICE).to(dtype)
    out = gguf_gemm_rows(x, blocks, qtype, programs_per_sm=programs_per_sm, dp4a=True, prequant=prequant)
    assert out.shape == (rows, 41) and out.dtype == dtype
    _assert_close(out, gguf_gemm.gguf_matmul_dp4a_ref(x, blocks, qtype), dtype)
    for r in range(rows):  # the same as one row at a time
        one = gguf_gemm_rows(x[r : r + 1], blocks, qtype, programs_per_sm=programs_per_sm, dp4a=True)
        _assert_close(out[r : r + 1], one.float(), dtype)
