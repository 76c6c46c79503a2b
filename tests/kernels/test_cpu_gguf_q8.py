"""The CPU's int8-activation GGUF product (mmserve/kernels/cpu/gguf_q8.c, cpu_gguf.q8_pack /
q8_gemm; --cpu-gguf-activations int8) for every type: the activations' rounding bit-equal to
_common.q8_round_trip (ggml's q8_1 by 32, as CUDA's dp4a products round them), and the product
within float32 rounding of gguf_matmul_dp4a_ref (the rounded activations times the gguf
package's dequantised weight) at 1-300 rows (partial panels of 16 channels, partial tiles of 16
rows, more than one block of 256 rows), any thread count giving the same bits; and measurably
not the exact float product, so a float path in its place fails these tests."""

from __future__ import annotations

import ctypes

import pytest
import torch

from mmserve.kernels import cpu_gguf, cpu_lib
from mmserve.kernels._common import q8_round_trip
from mmserve.kernels.gguf_blocks import FORMATS, gguf_dequantize_ref
from mmserve.kernels.gguf_gemm import gguf_matmul_dp4a_ref
from tests.kernels.test_gguf_gemm import random_blocks

pytestmark = pytest.mark.skipif(
    not cpu_gguf.q8_supported("Q4_0"), reason="no C library with AVX-512 VNNI here"
)
TYPES = list(FORMATS)
K = 224  # 7 blocks of 32 (the K-quants: 512, two super-blocks)


def _k(qtype: str) -> int:
    return 512 if qtype.endswith("_K") else K


def _quantise(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The library's rounding alone: int8 [M, K] and d [M, K / 32]."""
    m, k = x.shape
    xq, dx = torch.empty(m, k, dtype=torch.int8), torch.empty(m, k // 32)
    assert cpu_lib.require().gguf_q8_quantise(x.data_ptr(), m, k, x.stride(0), xq.data_ptr(), dx.data_ptr()) == 0
    return xq, dx


def test_activations_round_bit_equal_to_q8_round_trip() -> None:
    """Exact ties (half away from zero), a group of zeros, a group whose largest |x| is
    negative, values across many magnitudes."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, 256, generator=gen) * torch.logspace(-6, 6, 5).unsqueeze(1)
    x[1, :32] = -x[1, :32].abs()
    x[2, :32] = 0.0
    x[3, 32:64] = torch.linspace(-127, 126, 32)  # max |x| 127: x itself; integers, no ties
    x[3, 64:96] = torch.tensor([127.0, 0.5, -0.5, 1.5, -1.5, 2.5, -2.5] + [0.0] * 25)  # exact ties
    xq, dx = _quantise(x)
    expected = q8_round_trip(x)
    assert torch.equal(xq.float() * dx.repeat_interleave(32, dim=1), expected)
    assert xq[3, 64:71].tolist() == [127, 1, -1, 2, -2, 3, -3]  # half away from zero
    assert xq.abs().max() <= 127 and not xq[2, :32].any()


@pytest.mark.parametrize("rows", [1, 2, 15, 16, 17, 33, 300])
@pytest.mark.parametrize("qtype", TYPES)
def test_product_is_the_int8_activation_arithmetic(qtype: str, rows: int) -> None:
    """41 output channels: two panels of 16 and one of 9."""
    blocks = random_blocks(qtype, 41, _k(qtype), seed=rows).cpu()
    x = torch.randn(rows, _k(qtype), generator=torch.Generator().manual_seed(rows))
    packed = cpu_gguf.q8_pack(blocks, qtype)
    out = cpu_gguf.q8_gemm(x, packed, FORMATS[qtype].type_id, 41)
    expected = gguf_matmul_dp4a_ref(x, blocks, qtype).double()
    scale = expected.abs().max().item()
    assert out.shape == (rows, 41) and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=2e-6 * scale)
    exact = x.double() @ gguf_dequantize_ref(blocks, qtype).double().t()
    assert (exact - expected).abs().max().item() > 100 * 2e-6 * scale  # (the test can tell them apart)


def test_rows_with_a_stride_other_dtypes_and_threads() -> None:
    """x's rows apart (a view), bfloat16 x (computed from its float32 values), and one thread
    or two: the same bits."""
    blocks = random_blocks("Q4_1", 40, K, seed=3).cpu()
    packed = cpu_gguf.q8_pack(blocks, "Q4_1")
    wide = torch.randn(20, 2 * K)
    x = wide[:, :K]
    assert x.stride(0) == 2 * K
    out = cpu_gguf.q8_gemm(x, packed, FORMATS["Q4_1"].type_id, 40)
    assert torch.equal(out, cpu_gguf.q8_gemm(x.contiguous(), packed, FORMATS["Q4_1"].type_id, 40))
    half = x.to(torch.bfloat16)
    out16 = cpu_gguf.q8_gemm(half, packed, FORMATS["Q4_1"].type_id, 40)
    assert out16.dtype == torch.bfloat16
    assert torch.equal(out16, cpu_gguf.q8_gemm(half.float(), packed, FORMATS["Q4_1"].type_id, 40).to(torch.bfloat16))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu_gguf.q8_gemm(x, packed, FORMATS["Q4_1"].type_id, 40)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, out)


def test_nan_activations_give_nan_rows_only() -> None:
    blocks = random_blocks("Q8_0", 16, K, seed=4).cpu()
    x = torch.randn(3, K)
    x[1, 40] = float("nan")
    out = cpu_gguf.q8_gemm(x, cpu_gguf.q8_pack(blocks, "Q8_0"), FORMATS["Q8_0"].type_id, 16)
    assert out[1].isnan().all() and out[[0, 2]].isfinite().all()


def test_bad_inputs_are_refused() -> None:
    blocks = random_blocks("Q4_0", 16, K, seed=5).cpu()
    packed = cpu_gguf.q8_pack(blocks, "Q4_0")
    with pytest.raises(ValueError, match="qtype 'Q2_K'"):
        cpu_gguf.q8_pack(blocks, "Q2_K")
    with pytest.raises(ValueError, match="K = 224"):  # another K than the packed weight's
        cpu_gguf.q8_gemm(torch.randn(2, K + 32), packed, FORMATS["Q4_0"].type_id, 16)
    k_quant = cpu_gguf.q8_pack(random_blocks("Q6_K", 16, 512, seed=5).cpu(), "Q6_K")
    with pytest.raises(ValueError, match="K = 512"):
        cpu_gguf.q8_gemm(torch.randn(2, 256), k_quant, FORMATS["Q6_K"].type_id, 16)
    with pytest.raises(ValueError, match="the packed weight's \\(of 17 channels\\)"):  # (N too)
        cpu_gguf.q8_gemm(torch.randn(2, K), packed, FORMATS["Q4_0"].type_id, 17)
    assert not cpu_gguf.q8_supported("Q2_K") and cpu_gguf.q8_supported("Q6_K")


def test_a_build_without_vnni_has_none(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """skylake-avx512 (AVX-512 without VNNI): the product is not built, and says so."""
    lib = cpu_lib.load(cpu_lib.build(tmp_path, "skylake-avx512"))
    assert isinstance(lib, ctypes.CDLL)
    assert not lib.gguf_q8_supported(FORMATS["Q4_0"].type_id)
    assert not cpu_gguf.q8_supported("Q4_0", lib)


@pytest.mark.parametrize("qtype", ["Q4_1", "Q6_K"])
def test_a_row_parallel_cut_at_block_bounds_sums_to_the_whole(qtype: str) -> None:
    """Tensor parallelism cuts a row-parallel projection's K at whole blocks: each rank rounds
    its columns of x by the same groups of 32 as one rank does, so the ranks' partial products
    add up to the whole one (to float32 rounding)."""
    k = 3 * _k(qtype)
    blocks = random_blocks(qtype, 24, k, seed=6).cpu()
    x = torch.randn(5, k)
    whole = cpu_gguf.q8_gemm(x, cpu_gguf.q8_pack(blocks, qtype), FORMATS[qtype].type_id, 24)
    per_block = FORMATS[qtype].elements
    cut = blocks.shape[1] // 3
    parts = [
        cpu_gguf.q8_gemm(
            x[:, r * cut * per_block : (r + 1) * cut * per_block],
            cpu_gguf.q8_pack(blocks[:, r * cut : (r + 1) * cut].contiguous(), qtype),
            FORMATS[qtype].type_id,
            24,
        )
        for r in range(3)
    ]
    torch.testing.assert_close(sum(parts), whole, rtol=1e-5, atol=1e-5 * whole.abs().max().item())
