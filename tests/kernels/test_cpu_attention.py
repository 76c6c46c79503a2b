"""The CPU library's decode attention (mmserve/kernels/cpu_attention.py, cpu/paged_decode.c)
against the per-request reference attend() on random inputs: contexts read in place from
shuffled cache blocks, odd lengths and block boundaries, grouped-query heads, sliding windows,
a head size that is not a multiple of the vector width, the other machines' builds; and the
torch backend takes it for a float32 cache."""

from __future__ import annotations

import ctypes
from pathlib import Path

import pytest
import torch

from mmserve.kernels import cpu_attention, cpu_lib
from mmserve.kernels.paged_ref import attend, gather_context
from tests.kernels.test_cpu_gguf import BUILDS, _has

pytestmark = pytest.mark.skipif(not cpu_lib.available(), reason="the CPU library does not build here")
BLOCK = 16


@pytest.mark.parametrize(
    ("seq_lens", "heads", "kv_heads", "dim", "window"),
    [
        ([1], 4, 4, 64, None),
        ([5, 17, 16, 33, 1, 130], 9, 3, 64, None),
        ([40, 7, 64, 65], 8, 2, 128, 9),
        ([3, 300, 31], 12, 4, 72, None),  # 72: a tail past the last whole vector
        ([50, 20], 6, 6, 80, 50),  # a window as long as a context
    ],
)
def test_decode_equals_the_per_request_reference(
    seq_lens: list[int], heads: int, kv_heads: int, dim: int, window: int | None
) -> None:
    _check_against_the_reference(seq_lens, heads, kv_heads, dim, window, None)


def _check_against_the_reference(
    seq_lens: list[int], heads: int, kv_heads: int, dim: int, window: int | None, lib: ctypes.CDLL | None
) -> None:
    gen = torch.Generator().manual_seed(len(seq_lens) * dim)
    blocks = [-(-n // BLOCK) for n in seq_lens]
    num_blocks = sum(blocks) + 5
    order = torch.randperm(num_blocks, generator=gen)
    tables = torch.zeros(len(seq_lens), max(blocks), dtype=torch.int32)
    first = 0
    for i, count in enumerate(blocks):
        tables[i, :count] = order[first : first + count]
        first += count
    cache = torch.randn(2, num_blocks, BLOCK, kv_heads, dim, generator=gen)
    q = torch.randn(len(seq_lens), heads, dim, generator=gen)
    assert cpu_attention.supports(q, cache)
    got = cpu_attention.paged_decode_cpu(q, cache, tables, torch.tensor(seq_lens), dim**-0.5, window, lib)
    for i, n in enumerate(seq_lens):
        k, v = gather_context(cache, tables[i], n)
        expected = attend(q[i : i + 1], k, v, dim**-0.5, True, window)[0]
        torch.testing.assert_close(got[i], expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("march", list(BUILDS))
def test_other_machines_builds_attend_alike(march: str, tmp_path: Path) -> None:
    """The AVX2 build (8-lane score sums), AVX-512 without VBMI and the generic code: the same
    attention as the reference, head sizes 64, 128 and 72 (the run-time path)."""
    if not _has("avx2", "fma", "f16c", *BUILDS[march]):
        pytest.skip(f"this machine cannot run the {march} build")
    lib = cpu_lib.load(cpu_lib.build(tmp_path, march))
    for seq_lens, heads, kv_heads, dim, window in [([5, 17, 33, 1], 9, 3, 64, None), ([40, 7], 8, 2, 128, 9),
                                                    ([3, 31], 12, 4, 72, None)]:  # fmt: skip
        _check_against_the_reference(seq_lens, heads, kv_heads, dim, window, lib)


def test_only_float32_caches_and_fitting_shapes() -> None:
    q, cache = torch.randn(2, 4, 64), torch.randn(2, 3, BLOCK, 2, 64)
    assert not cpu_attention.supports(q.bfloat16(), cache.bfloat16())
    assert not cpu_attention.supports(q, cache.transpose(3, 4))  # not contiguous
    tables = torch.tensor([[0], [2]], dtype=torch.int32)
    with pytest.raises(ValueError, match="do not fit together"):
        cpu_attention.paged_decode_cpu(q, cache[..., :32], tables, torch.tensor([3, 4]), 0.1, None)
    # a block id past the cache, or a context longer than its table: refused, nothing read
    for bad_tables, lens in ((torch.tensor([[0], [3]], dtype=torch.int32), [3, 4]), (tables, [3, 17])):
        with pytest.raises(RuntimeError, match=r"failed \(-3\)"):
            cpu_attention.paged_decode_cpu(q, cache, bad_tables, torch.tensor(lens), 0.1, None)
