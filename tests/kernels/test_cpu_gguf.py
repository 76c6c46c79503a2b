"""The CPU's GGUF library (mmserve/kernels/cpu_gguf.py, mmserve/kernels/cpu/*.c) against the
gguf package's own dequantiser, for every supported type: the dequantised weights bit-equal,
products of 1-300 rows (the library's register tiles of 4 rows x 4 channels, partial ones at
both edges; its outer-product path over 16-channel panels, up to 16 rows a block at a time in
registers, more in several chunks of k and blocks of rows; past MAX_ROWS the many-rows path)
within float32 rounding and, against one-hot rows, exactly; any thread count giving the same bits; the builds for AVX2, AVX-512 without VBMI and
no vectors alike; a library that cannot be built leaves it unavailable instead of failing."""

from __future__ import annotations

import logging
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from mmserve.kernels import cpu_gguf, cpu_lib
from mmserve.kernels.gguf_blocks import FORMATS, gguf_dequantize_ref
from tests.kernels.test_gguf_gemm import random_blocks

pytestmark = pytest.mark.skipif(not cpu_lib.available(), reason="no C compiler with OpenMP here")
TYPES = list(FORMATS)
# 7 blocks of 32, 2 super-blocks of 256 (K a multiple of 16 lanes, not of 128)
K = {"legacy": 224, "k_quant": 512}


def _k(qtype: str) -> int:
    return K["k_quant" if qtype.endswith("_K") else "legacy"]


def _blocks(qtype: str, n: int, seed: int = 0) -> torch.Tensor:
    return random_blocks(qtype, n, _k(qtype), seed).cpu()


@pytest.mark.parametrize("qtype", TYPES)
def test_dequantize_is_bit_equal_to_ggufs(qtype: str) -> None:
    blocks = _blocks(qtype, 37)
    assert torch.equal(cpu_gguf.gguf_dequantize_cpu(blocks, qtype), gguf_dequantize_ref(blocks, qtype))


@pytest.fixture(params=[True, False], ids=["panels", "tiles"])
def panels(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> bool:
    """The 32-element types' outer-product path where the build has it, or the 4 x 4 tiles up to
    MAX_ROWS rows and the dequantised weight and torch.matmul past them (the processor picks
    one: both are tested here)."""
    monkeypatch.setattr(cpu_gguf, "PANELS", request.param)
    return request.param


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 16, 17, 128, 129, 300])
@pytest.mark.parametrize("qtype", TYPES)
def test_product_is_x_times_ggufs_weight(qtype: str, rows: int, panels: bool) -> None:
    """41 output channels: 10 groups of 4 and one of 1. Up to MAX_ROWS rows the library's
    product (the 32-element types' outer-product path from 4 rows where it runs), more that
    path or the dequantised weight and torch.matmul."""
    blocks = _blocks(qtype, 41, seed=rows)
    x = torch.randn(rows, _k(qtype), generator=torch.Generator().manual_seed(rows))
    out = cpu_gguf.gguf_gemm_cpu(x, blocks, qtype)
    expected = x.double() @ gguf_dequantize_ref(blocks, qtype).double().t()
    assert out.shape == (rows, 41) and out.dtype == torch.float32
    scale = expected.abs().max().item()
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5 * scale)


@pytest.mark.parametrize("rows", [4, 16, 33, 300])
@pytest.mark.parametrize(("qtype", "k"), [("Q4_0", 608), ("Q5_1", 608), ("Q8_0", 608), ("Q4_1", 1024), ("Q4_K", 768)])
def test_products_over_several_chunks_of_k_and_blocks_of_rows(
    qtype: str, k: int, rows: int, panels: bool
) -> None:
    """K = 608: three chunks of the outer-product path (256, 256, 96); K = 1024: rows 4 KiB
    apart, which that path copies further apart; 300 rows are two blocks of 256 rows there."""
    blocks = random_blocks(qtype, 41, k, rows).cpu()
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    expected = x.double() @ gguf_dequantize_ref(blocks, qtype).double().t()
    out = cpu_gguf.gguf_gemm_cpu(x, blocks, qtype)
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())


@pytest.mark.parametrize("qtype", TYPES)
def test_one_hot_rows_give_the_weights_exactly(qtype: str, panels: bool) -> None:
    """Row i of the identity picks weight column i: every path's product must give the
    dequantised weights bit for bit (all rows at once and 16 at a time: the outer-product path
    where the build has it; 3: the 4 x 4 tiles; 1: the one-row products)."""
    blocks = _blocks(qtype, 41)
    weight = gguf_dequantize_ref(blocks, qtype)
    eye = torch.eye(_k(qtype))
    for rows in (eye.shape[0], 16, 3, 1):
        for start in range(0, eye.shape[0], rows):
            out = cpu_gguf.gguf_gemm_cpu(eye[start : start + rows], blocks, qtype)
            assert torch.equal(out, weight[:, start : start + rows].t()), (qtype, rows, start)


def test_rows_with_a_stride_and_other_dtypes() -> None:
    """x may be a view whose rows are apart (a slice of a wider activation); a bfloat16 x is
    multiplied in float32 and comes back bfloat16."""
    blocks = _blocks("Q4_1", 9)
    wide = torch.randn(3, 2 * 224)
    x = wide[:, :224]
    expected = x @ gguf_dequantize_ref(blocks, "Q4_1").t()
    torch.testing.assert_close(cpu_gguf.gguf_gemm_cpu(x, blocks, "Q4_1"), expected)
    out = cpu_gguf.gguf_gemm_cpu(x.bfloat16(), blocks, "Q4_1")
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), x.bfloat16().float() @ gguf_dequantize_ref(blocks, "Q4_1").t(),
                               rtol=1.6e-2, atol=5e-2)  # fmt: skip


def test_threads_do_not_change_the_bits() -> None:
    """Each output is one thread's sum, whatever the number of threads."""
    blocks, x = _blocks("Q6_K", 64), torch.randn(5, 512)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu_gguf.gguf_gemm_cpu(x, blocks, "Q6_K")
        torch.set_num_threads(2)
        two = cpu_gguf.gguf_gemm_cpu(x, blocks, "Q6_K")
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)


@pytest.mark.skipif(
    not (cpu_lib.available() and cpu_lib.library().gguf_panel_supported(FORMATS["Q4_1"].type_id)),
    reason="no outer-product path in this build",
)
def test_panels_choose_the_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """PANELS reaches the library: the outer-product path and the tiles sum in other orders, so
    at 16 rows their outputs differ in the last bits (both within rounding of the weight)."""
    blocks, x = _blocks("Q4_1", 41), torch.randn(16, 224, generator=torch.Generator().manual_seed(3))
    outs = []
    for panels in (True, False):
        monkeypatch.setattr(cpu_gguf, "PANELS", panels)
        outs.append(cpu_gguf.gguf_gemm_cpu(x, blocks, "Q4_1"))
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-4)
    assert not torch.equal(outs[0], outs[1])


@pytest.mark.skipif(
    not cpu_lib.available() or not cpu_lib.require().gguf_panel_supported(FORMATS["Q4_1"].type_id),
    reason="no outer-product path in this build",
)
@pytest.mark.parametrize("qtype", TYPES)
def test_up_to_16_rows_sum_as_the_chunked_panels_do(qtype: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Up to 16 rows multiply each block as it is dequantised (odd counts with a row of zeros),
    more through chunks of dequantised weights: both sum each output in the order of k, so a
    row's outputs are the same bits whether 2, 3, 4, 5, 15 or 16 rows go (the first rows of
    17), over K = 1,056 (33 blocks: five chunks of the other path; 1,280, five super-blocks, for the
    K-quants) and 45 channels (a partial panel)."""
    monkeypatch.setattr(cpu_gguf, "PANELS", True)
    k = 1280 if qtype.endswith("_K") else 1056
    blocks = random_blocks(qtype, 45, k, 7).cpu()
    x = torch.randn(17, k, generator=torch.Generator().manual_seed(5))
    chunked = cpu_gguf.gguf_gemm_cpu(x, blocks, qtype)
    expected = x.double() @ gguf_dequantize_ref(blocks, qtype).double().t()
    torch.testing.assert_close(chunked.double(), expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())
    for rows in (2, 3, 4, 5, 15, 16):
        assert torch.equal(cpu_gguf.gguf_gemm_cpu(x[:rows], blocks, qtype), chunked[:rows]), rows


def test_panels_by_the_processor(monkeypatch: pytest.MonkeyPatch) -> None:
    """Unset, the outer-product path runs except on Intel processors with MKL (where the tiles
    and MKL's float32 GEMM win); set, as set."""
    monkeypatch.setattr(cpu_gguf, "PANELS", None)
    for vendor, mkl, expected in [("GenuineIntel", True, False), ("GenuineIntel", False, True),
                                  ("AuthenticAMD", True, True), ("", True, True)]:  # fmt: skip
        cpu_gguf._mkl_on_intel.cache_clear()
        monkeypatch.setattr(cpu_lib, "cpu_vendor", lambda v=vendor: v)
        monkeypatch.setattr(torch.backends.mkl, "is_available", lambda m=mkl: m)
        assert cpu_gguf.use_panels() is expected, (vendor, mkl)
    cpu_gguf._mkl_on_intel.cache_clear()
    monkeypatch.setattr(cpu_gguf, "PANELS", True)
    assert cpu_gguf.use_panels()


def _has(*flags: str) -> bool:
    try:
        info = Path("/proc/cpuinfo").read_text().split()
    except OSError:
        return False
    return all(flag in info for flag in flags)


# what each build needs of the machine that runs it
BUILDS = {"haswell": ("avx2", "fma", "f16c"), "skylake-avx512": ("avx512f", "avx512bw", "avx512dq", "avx512vl"),
          "x86-64": ()}  # fmt: skip


@pytest.mark.parametrize("march", list(BUILDS))
def test_other_machines_builds_give_the_same_weights(march: str, tmp_path: Path) -> None:
    """The library as an AVX2 machine builds it (8 lanes, 2-row tiles), as an AVX-512 machine
    without VBMI does (16 lanes, no outer-product path) and as a machine without AVX2 does
    (the generic code, which library() does not use): every type's weights bit-equal,
    products of 1-17 rows within float32 rounding."""
    if not _has("avx2", "fma", "f16c", *BUILDS[march]):  # (an x86 machine, for any of them)
        pytest.skip(f"this machine cannot run the {march} build")
    lib = cpu_lib.load(cpu_lib.build(tmp_path, march))
    assert lib.gguf_cpu_vectorised() == (march != "x86-64")
    assert not lib.gguf_panel_supported(FORMATS["Q4_1"].type_id)
    for qtype in TYPES:
        blocks = _blocks(qtype, 11)
        weight = gguf_dequantize_ref(blocks, qtype)
        assert torch.equal(cpu_gguf.gguf_dequantize_cpu(blocks, qtype, lib), weight), qtype
        x = torch.randn(17, _k(qtype))
        for rows in (1, 2, 5, 17):
            out = cpu_gguf.gguf_gemm_cpu(x[:rows], blocks, qtype, lib)
            torch.testing.assert_close(out, x[:rows] @ weight.t(), rtol=1e-5, atol=1e-5 * weight.abs().max().item())


@pytest.mark.parametrize("level", ["-O0", "-O1"])
def test_the_sources_compile_without_optimisation(level: str, tmp_path: Path) -> None:
    """Intrinsics whose lane must be a literal are spelled out, not left to the optimiser's
    unrolling (gguf_panel.c's inserts and extracts compiled at -O3 only, once): another
    compiler or level must build the library too."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler")
    for source in sorted(cpu_lib.SOURCE_DIR.glob("*.c")):
        command = [cc, level, "-march=native", "-fPIC", "-fopenmp", "-c", str(source), "-o", str(tmp_path / "a.o")]
        done = subprocess.run(command, check=False, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, (source.name, done.stderr[-2000:])


def test_bad_inputs_are_refused_naming_them() -> None:
    blocks = _blocks("Q8_0", 4)
    with pytest.raises(ValueError, match="K = 224"):
        cpu_gguf.gguf_gemm_cpu(torch.randn(2, 200), blocks, "Q8_0")
    with pytest.raises(ValueError, match="qtype 'Q2_K'"):
        cpu_gguf.gguf_gemm_cpu(torch.randn(2, 224), blocks, "Q2_K")
    with pytest.raises(ValueError, match="blocks must be uint8"):
        cpu_gguf.gguf_gemm_cpu(torch.randn(2, 224), blocks.float(), "Q8_0")
    with pytest.raises(ValueError, match="34 bytes per Q8_0 block"):  # (Q4_1's 20-byte blocks)
        cpu_gguf.gguf_gemm_cpu(torch.randn(2, 224), _blocks("Q4_1", 4), "Q8_0")
    with pytest.raises(ValueError, match="blocks must be contiguous"):
        cpu_gguf.gguf_dequantize_cpu(_blocks("Q8_0", 4)[::2], "Q8_0")


def test_no_compiler_leaves_the_library_unavailable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A machine without a working C compiler (or with the kernels switched off) has none;
    the loader then dequantises GGUF weights at load."""
    monkeypatch.setenv("MMSERVE_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    cpu_lib.library.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger=cpu_lib.__name__):
            assert not cpu_lib.available()
        assert "CPU kernels off" in caplog.text
        monkeypatch.delenv("CC")
        monkeypatch.setenv("MMSERVE_CPU_KERNELS", "0")
        cpu_lib.library.cache_clear()
        assert not cpu_lib.available()
        monkeypatch.delenv("MMSERVE_CPU_KERNELS")
        cpu_lib.library.cache_clear()
        assert cpu_lib.available()  # built anew into tmp_path
        assert list((tmp_path / "cpu-kernels").glob("mmserve-*.so"))
    finally:
        cpu_lib.library.cache_clear()
