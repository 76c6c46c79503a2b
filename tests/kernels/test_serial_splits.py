"""Split products finished by their last program (_common.SERIAL_SPLITS): every product kernel
whose K is split, with the partials added up by the last program of each tile, gives sum_splits'
result to the bit, runs no second kernel, and leaves its counters zero for the next product
(on CUDA, many times over, so that a missing fence or barrier shows as a wrong sum)."""

from __future__ import annotations

import pytest
import torch

from mmserve.kernels import _common, fp8_gemm
from mmserve.kernels.fp8_gemm import fp8_gemm_rows
from mmserve.kernels.gguf_gemm import gguf_gemm_rows
from mmserve.kernels.gguf_planes import q6k_planes
from mmserve.kernels.quant import per_token_quant_ref, quantize_weight_fp8
from mmserve.kernels.wna16 import pack_columns, wna16_gemm
from tests.kernels.conftest import DEVICE
from tests.kernels.test_gguf_gemm import random_blocks

REPEATS = 50 if DEVICE.type == "cuda" else 1
SUM, SCALE = (_common, "sum_splits"), (fp8_gemm, "_scale")  # the second kernels' launchers


def _products():  # type: ignore[no-untyped-def]
    """(name, a function computing one product whose K is split, the module and name of the
    second kernel's launcher it skips) for each kernel family."""
    g = torch.Generator().manual_seed(0)
    cases = []
    for qtype, rows, dtype, forms in [
        ("Q4_K", 1, torch.float16, {"dp4a": True}),  # _gguf_dp4a_kernel, one row
        ("Q5_K", 3, torch.float16, {"dp4a": True}),  # several rows, one program (and counter) a tile
        ("Q6_K", 1, torch.float16, {"dp4a": True}),  # _gguf_q6k_dp4a_kernel
        ("Q4_K", 1, torch.float32, {"gemv": True}),  # _gguf_gemv_kernel
        ("Q4_0", 5, torch.float32, {}),  # _gguf_gemm_rows_kernel
        ("Q6_K", 2, torch.float16, {"lowp": True}),
    ]:
        blocks = random_blocks(qtype, 96, 1024, seed=rows)
        x = torch.randn(rows, 1024, generator=g).to(dtype).to(DEVICE)
        cases.append((f"gguf-{qtype}-{rows}-{forms}", lambda x=x, b=blocks, q=qtype, f=forms: gguf_gemm_rows(x, b, q, **f), SUM))
    planes, x = q6k_planes(random_blocks("Q6_K", 96, 1024, seed=2)), torch.randn(2, 1024, generator=g).half().to(DEVICE)
    cases.append(("gguf-Q6_K-planes-2-dp4a", lambda x=x, p=planes: gguf_gemm_rows(x, p, "Q6_K", dp4a=True), SUM))  # several rows
    wna16_cases = [(1, torch.float16, 128, True), (3, torch.float16, 128, True), (3, torch.float32, 64, False), (2, torch.float16, 128, False)]
    for rows, dtype, group_size, dp4a in wna16_cases:
        q = torch.randint(0, 16, (1024, 80), generator=g)
        scales = (torch.rand(1024 // group_size, 80, generator=g) * 0.02).to(dtype)
        zeros = torch.randint(0, 16, (1024 // group_size, 80), generator=g).to(dtype)
        x = torch.randn(rows, 1024, generator=g).to(dtype)
        args = [t.to(DEVICE) for t in (x, pack_columns(q, 4), scales, zeros)]
        cases.append((f"wna16-{rows}-{dtype}-{dp4a}", lambda a=args, gs=group_size, d=dp4a: wna16_gemm(*a, 4, gs, dp4a=d), SUM))
    for rows, int8 in [(1, False), (5, False), (3, True)]:  # _fp8_gemm_rows_kernel: the sums scaled too
        xq, xs = per_token_quant_ref(torch.randn(rows, 1024, generator=g).to(DEVICE))
        wq, ws = quantize_weight_fp8(torch.randn(96, 1024, generator=g).to(DEVICE))
        if int8:
            xq = torch.randint(-127, 128, xq.shape, generator=g, dtype=torch.int8).to(DEVICE)
            wq = torch.randint(-127, 128, wq.shape, generator=g, dtype=torch.int8).to(DEVICE)
        operands = (xq, xs, wq, ws.view(1, -1))
        cases.append((f"fp8-{rows}-{int8}", lambda o=operands: fp8_gemm_rows(*o, torch.float16, block_k=128, splits=3), SCALE))
    return cases


PRODUCTS = _products()


def _spy(monkeypatch, second):  # type: ignore[no-untyped-def]
    """The calls of the second kernel's launcher (each one's partials' slices)."""
    module, name = second
    calls: list[int] = []
    real = getattr(module, name)
    monkeypatch.setattr(module, name, lambda out, part, *rest: calls.append(part.shape[0]) or real(out, part, *rest))
    return calls


@pytest.mark.parametrize(("product", "second"), [p[1:] for p in PRODUCTS], ids=[p[0] for p in PRODUCTS])
def test_last_program_sums_the_splits_as_the_second_kernel_does(product, second, monkeypatch):  # type: ignore[no-untyped-def]
    calls = _spy(monkeypatch, second)
    monkeypatch.setattr(_common, "SERIAL_SPLITS", False)  # (the default is on)
    expected = product()
    assert calls and calls[0] > 1  # (the case splits K)
    monkeypatch.setattr(_common, "SERIAL_SPLITS", True)
    calls.clear()
    for _ in range(REPEATS):
        assert torch.equal(product(), expected)
    assert not calls  # no second kernel
    assert not any(c.any() for c in _common._counters.values())  # every counter back to zero


def test_more_programs_than_counters_fall_back_to_sum_splits(monkeypatch):  # type: ignore[no-untyped-def]
    for _, product, second in (PRODUCTS[0], PRODUCTS[-1]):
        expected = product()
        monkeypatch.setattr(_common, "SERIAL_SPLITS", True)
        monkeypatch.setattr(_common, "MAX_COUNTERS", 0)
        calls = _spy(monkeypatch, second)
        assert torch.equal(product(), expected) and calls
        monkeypatch.undo()
