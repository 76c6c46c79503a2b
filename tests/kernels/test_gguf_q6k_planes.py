"""Q6_K in planes (mmserve/kernels/gguf_planes.py, gguf_gemm.Q6K_ALIGNED): the reordering is exact
and reversible, the int8-activation product on planes (one row, and several: each row's
arithmetic the one row's) does the arithmetic of the one on the file's blocks, every other
product and the dequantiser read planes as they read blocks, and GgufLinear repacks only with
the switch on (on CUDA)."""

from __future__ import annotations

import pytest
import torch

from mmserve.kernels import _common, gguf_gemm
from mmserve.kernels.gguf_blocks import gguf_dequantize, gguf_dequantize_ref
from mmserve.kernels.gguf_gemm import gguf_gemm_rows, gguf_matmul, gguf_matmul_dp4a_ref
from mmserve.kernels.gguf_planes import plane_row_bytes, q6k_blocks, q6k_planes
from mmserve.models import gguf_linear
from mmserve.models.gguf_linear import GgufLinear
from tests.kernels.conftest import DEVICE
from tests.kernels.test_gguf_gemm import _assert_close, random_blocks


def _same(out: torch.Tensor, expected: torch.Tensor) -> None:
    """The same arithmetic on either layout: to the bit in the interpreter; compiled for a GPU,
    within a rounding of the dtype (the two kernels' code may fuse multiply-adds apart)."""
    if DEVICE.type == "cuda":
        tol = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 8e-3}[out.dtype]
        torch.testing.assert_close(out, expected, rtol=tol, atol=tol * expected.float().abs().max().item())
    else:
        assert torch.equal(out, expected)


@pytest.mark.parametrize("num_blocks", [1, 3, 8])
def test_q6k_planes_are_the_blocks_reordered(num_blocks: int) -> None:
    """Back to the same bytes; the same weights by gguf's dequantiser; 210 bytes a block, the
    row padded to 16 (none at 8 blocks a row)."""
    blocks = random_blocks("Q6_K", 37, 256 * num_blocks, seed=num_blocks)
    planes = q6k_planes(blocks)
    assert planes.shape == (37, plane_row_bytes(num_blocks)) and planes.dtype == torch.uint8
    assert planes.shape[1] - 210 * num_blocks == {1: 14, 3: 10, 8: 0}[num_blocks]
    assert torch.equal(q6k_blocks(planes), blocks)
    assert torch.equal(gguf_dequantize_ref(planes, "Q6_K"), gguf_dequantize_ref(blocks, "Q6_K"))
    # ql, qh, scales, d: each field of row 5's block 0 where the planes put it
    row = planes[5]
    assert torch.equal(row[:128], blocks[5, 0, :128])
    assert torch.equal(row[128 * num_blocks : 128 * num_blocks + 64], blocks[5, 0, 128:192])
    assert torch.equal(row[192 * num_blocks : 192 * num_blocks + 16], blocks[5, 0, 192:208])
    assert torch.equal(row[208 * num_blocks : 208 * num_blocks + 2], blocks[5, 0, 208:210])


# (programs_per_sm, SERIAL_SPLITS): K unsplit (where SERIAL_SPLITS is not read), split and summed by
# a second kernel, split and summed by the last program
SPLITS = [(0, False), (4, False), (4, True)]


@pytest.mark.parametrize(("programs_per_sm", "serial"), SPLITS)
@pytest.mark.parametrize("num_blocks", [3, 8])
def test_q6k_planes_one_row_in_int8_activations(
    num_blocks: int, programs_per_sm: int, serial: bool, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The one-row dp4a product on planes: gguf_matmul_dp4a_ref's arithmetic (tightly), the file
    layout's kernel to the bit, within int8 rounding of the exact product; 41 channels (a
    partial tile), K unsplit and split (summed by a second kernel or by the last program)."""
    monkeypatch.setattr(_common, "SERIAL_SPLITS", serial)
    k = 256 * num_blocks
    blocks = random_blocks("Q6_K", 41, k, seed=num_blocks + programs_per_sm)
    planes = q6k_planes(blocks)
    x = torch.randn(1, k, device=DEVICE)
    x[0, 32:64], x[0, 300] = 0.0, 40.0
    x = x.to(dtype)
    out = gguf_gemm_rows(x, planes, "Q6_K", programs_per_sm=programs_per_sm, dp4a=True)
    assert out.shape == (1, 41) and out.dtype == dtype
    _assert_close(out, gguf_matmul_dp4a_ref(x, blocks, "Q6_K"), dtype)
    file_layout = gguf_gemm_rows(x, blocks, "Q6_K", programs_per_sm=programs_per_sm, dp4a=True)
    _same(out, file_layout)
    exact = gguf_gemm.gguf_matmul_ref(x, blocks, "Q6_K")
    assert ((out.float() - exact).norm() / exact.norm()).item() < 2e-2


@pytest.mark.parametrize(("programs_per_sm", "serial"), SPLITS)
@pytest.mark.parametrize(("rows", "num_blocks"), [(2, 3), (2, 8), (3, 3), (4, 1)])
def test_q6k_several_rows_in_int8_activations(
    rows: int, num_blocks: int, programs_per_sm: int, serial: bool, dtype: torch.dtype,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    """Several rows in one program (the tile's quants unpacked once): gguf_matmul_dp4a_ref's
    arithmetic (tightly), each row the one-row kernel's result to the bit, on planes and on the
    file's blocks alike; 43 channels (a partial tile), K unsplit and split (summed by a second
    kernel or by the last program)."""
    monkeypatch.setattr(_common, "SERIAL_SPLITS", serial)
    k = 256 * num_blocks
    blocks = random_blocks("Q6_K", 43, k, seed=rows + num_blocks + programs_per_sm)
    planes = q6k_planes(blocks)
    x = torch.randn(rows, k, device=DEVICE)
    x[1, 32:64], x[0, 200] = 0.0, 40.0
    x = x.to(dtype)
    out = gguf_gemm_rows(x, planes, "Q6_K", programs_per_sm=programs_per_sm, dp4a=True)
    assert out.shape == (rows, 43) and out.dtype == dtype
    _assert_close(out, gguf_matmul_dp4a_ref(x, blocks, "Q6_K"), dtype)
    _same(out, gguf_gemm_rows(x, blocks, "Q6_K", programs_per_sm=programs_per_sm, dp4a=True))
    for r in range(rows):
        _same(out[r : r + 1], gguf_gemm_rows(x[r : r + 1], planes, "Q6_K", programs_per_sm=programs_per_sm, dp4a=True))


def test_q6k_planes_take_int8_activations_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    """gguf_matmul on planes: one 16-bit row through dp4a (gguf_product_ref says so too); up to
    DP4A_MAX_ROWS rows only with Q6K_ALIGNED on; float32 and more rows not; the file's blocks
    keep LOWP (Q6_K is not in DP4A_TYPES)."""
    monkeypatch.setattr(gguf_gemm, "Q6K_ALIGNED", False)
    blocks = random_blocks("Q6_K", 41, 512, seed=1)
    planes = q6k_planes(blocks)
    x = torch.randn(gguf_gemm.DP4A_MAX_ROWS + 1, 512, device=DEVICE).half()
    two = x[: gguf_gemm.DP4A_MAX_ROWS]
    assert gguf_gemm.uses_dp4a(x[:1], "Q6_K", planes=True)
    assert not gguf_gemm.uses_dp4a(two, "Q6_K", planes=True) and not gguf_gemm.uses_dp4a(x[:1], "Q6_K")
    assert not gguf_gemm.uses_dp4a(x[:1].float(), "Q6_K", planes=True)
    one = gguf_matmul(x[:1], planes, "Q6_K")
    _same(one, gguf_gemm_rows(x[:1], blocks, "Q6_K", dp4a=True))
    _assert_close(one, gguf_gemm.gguf_product_ref(x[:1], planes, "Q6_K"), torch.float16)
    monkeypatch.setattr(gguf_gemm, "Q6K_ALIGNED", True)
    assert gguf_gemm.uses_dp4a(two, "Q6_K", planes=True) and not gguf_gemm.uses_dp4a(two, "Q6_K")
    assert not gguf_gemm.uses_dp4a(x, "Q6_K", planes=True) and not gguf_gemm.uses_dp4a(two.float(), "Q6_K", planes=True)
    several = gguf_matmul(two, planes, "Q6_K")
    _same(several, gguf_gemm_rows(two, blocks, "Q6_K", dp4a=True))
    _assert_close(several, gguf_gemm.gguf_product_ref(two, planes, "Q6_K"), torch.float16)


@pytest.mark.parametrize("rows", [1, 2, 7, 16, 20])
def test_q6k_planes_in_every_other_product(rows: int, dtype: torch.dtype) -> None:
    """Without int8 activations (LOWP in 16 bits, float32, the GEMV kernel, more rows than
    MAX_ROWS: dequantised, then matmul) and split K: planes give the blocks' result to the bit."""
    k = 3 * 256
    blocks = random_blocks("Q6_K", 45, k, seed=rows)
    planes = q6k_planes(blocks)
    x = torch.randn(rows, k, device=DEVICE).to(dtype)
    for programs in (0, 4):
        if rows <= gguf_gemm.MAX_ROWS:
            a = gguf_gemm_rows(x, planes, "Q6_K", programs_per_sm=programs, dp4a=False)
            _same(a, gguf_gemm_rows(x, blocks, "Q6_K", programs_per_sm=programs, dp4a=False))
        if rows == 1:
            a = gguf_gemm_rows(x, planes, "Q6_K", programs_per_sm=programs, gemv=True, dp4a=False)
            _same(a, gguf_gemm_rows(x, blocks, "Q6_K", programs_per_sm=programs, gemv=True, dp4a=False))
    if rows > gguf_gemm.MAX_ROWS:
        _same(gguf_matmul(x, planes, "Q6_K"), gguf_matmul(x, blocks, "Q6_K"))
        chunked = gguf_matmul(x, planes, "Q6_K", chunk_elements=16 * k)  # 16 rows of W at a time
        _assert_close(chunked, gguf_gemm.gguf_matmul_ref(x, blocks, "Q6_K"), dtype)


@pytest.mark.parametrize("lowp", [False, True])
def test_q6k_planes_dequantised(lowp: bool, dtype: torch.dtype) -> None:
    blocks = random_blocks("Q6_K", 37, 3 * 256, seed=2)
    out = gguf_dequantize(q6k_planes(blocks), "Q6_K", dtype, lowp=lowp)
    _same(out, gguf_dequantize(blocks, "Q6_K", dtype, lowp=lowp))


def test_q6k_planes_rejected_when_malformed() -> None:
    planes = q6k_planes(random_blocks("Q6_K", 4, 768))
    x = torch.randn(1, 768, device=DEVICE)
    with pytest.raises(ValueError, match="Q6_K planes"):
        gguf_matmul(x, planes[:, :-16].contiguous(), "Q6_K")
    with pytest.raises(ValueError, match=r"\(3-D\)"):
        gguf_matmul(x, planes, "Q4_K")
    with pytest.raises(ValueError, match="Q6_K blocks"):
        q6k_planes(planes)


def _linear(dtype: torch.dtype) -> tuple[GgufLinear, list[torch.Tensor]]:
    """A merged projection of Q4_K, Q6_K (two checkpoint tensors, joined) and float rows."""
    k = 512
    parts = [random_blocks("Q4_K", 24, k, 1), random_blocks("Q6_K", 5, k, 2), random_blocks("Q6_K", 3, k, 3)]
    parts.append(torch.randn(8, k, generator=torch.Generator().manual_seed(4)).to(DEVICE, dtype))
    linear = GgufLinear(k, 40, None, dtype, DEVICE)
    for i, (start, stop) in enumerate([(0, 24), (24, 29), (29, 32), (32, 40)]):
        linear.load_rows(parts[i], f"part{i}", slice(start, stop))
    linear.finish()
    return linear, parts


def test_q6k_aligned_switch_repacks_q6k_runs_on_cuda(dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    """Q6K_ALIGNED on a CUDA device (here: made to say so): the Q6_K run is in planes, the
    others are as loaded, and the products (one and two rows through dp4a, a few, many) are the file
    layout's; on the CPU the switch repacks nothing (the C library reads blocks)."""
    monkeypatch.setattr(gguf_gemm, "Q6K_ALIGNED", True)
    assert not gguf_linear.aligns_q6k(torch.device("cpu"))
    monkeypatch.setattr(gguf_linear, "aligns_q6k", lambda device: True)
    aligned, parts = _linear(dtype)
    monkeypatch.setattr(gguf_linear, "aligns_q6k", lambda device: False)
    plain, _ = _linear(dtype)
    assert [p.qtype for p in aligned.parts] == ["Q4_K", "Q6_K", None]
    assert torch.equal(aligned.part0, parts[0]) and torch.equal(aligned.part2, parts[3])
    assert torch.equal(aligned.part1, q6k_planes(torch.cat(parts[1:3]))) and aligned.part1.dim() == 2
    held = plain.held_bytes()  # 2 blocks a row: 420 bytes, padded to 432 in planes
    assert aligned.held_bytes() == {**held, "Q6_K": held["Q6_K"] + 8 * 12}
    for rows in (1, 2, 3, gguf_gemm.MAX_ROWS + 4):
        x = torch.randn(rows, 512, device=DEVICE).to(dtype)
        out = aligned(x, use_kernels=True)
        if rows <= gguf_gemm.DP4A_MAX_ROWS and dtype != torch.float32:  # Q6_K through dp4a on planes only
            q6k = gguf_gemm_rows(x, torch.cat(parts[1:3]), "Q6_K", dp4a=True)
            _same(out[:, 24:32], q6k)
            _same(out[:, :24], plain(x, use_kernels=True)[:, :24])
        else:
            _same(out, plain(x, use_kernels=True))
        _assert_close(aligned(x, use_kernels=False), plain(x, use_kernels=False).float(), dtype)


def test_q6k_aligned_off_keeps_the_files_blocks(dtype: torch.dtype, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Q6K_ALIGNED off (the default until session 28): every run keeps the file's blocks, 3-D."""
    monkeypatch.setattr(gguf_gemm, "Q6K_ALIGNED", False)
    linear, parts = _linear(dtype)
    assert torch.equal(linear.part1, torch.cat(parts[1:3])) and linear.part1.dim() == 3
    x = torch.randn(1, 512, device=DEVICE).to(dtype)
    _same(linear(x, use_kernels=True)[:, 24:32], gguf_gemm_rows(x, linear.part1, "Q6_K"))
