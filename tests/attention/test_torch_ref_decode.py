"""The batched paths of the torch attention backend (one padded attention for every request
that decodes a token, or the C library's in-place reads of a float32 cache; prompts with
nothing cached before them batched by length) equal the per-request reference on random
inputs: odd context lengths, block boundaries, GQA, sliding windows, FP8 caches, and steps
that mix fresh prompts and chunks after a cached prefix with decodes."""

from __future__ import annotations

import pytest
import torch

from mmserve.attention.backend import AttentionMetadata
from mmserve.attention.torch_ref import TorchAttentionBackend, attend_context
from mmserve.kernels import cpu_attention, cpu_lib
from mmserve.kernels.paged_ref import FP8, attend, gather_context, write_kv_cache

BLOCK = 16


def _step(
    query_lens: list[int], seq_lens: list[int], kv_heads: int, dtype: torch.dtype, seed: int = 0
) -> tuple[AttentionMetadata, torch.Tensor, torch.Generator]:
    """A step's metadata over shuffled blocks, and a cache whose earlier positions hold random
    K/V (the step's own tokens are written by the backend)."""
    gen = torch.Generator().manual_seed(seed)
    blocks = [-(-n // BLOCK) for n in seq_lens]
    num_blocks = sum(blocks) + 3
    order = torch.randperm(num_blocks, generator=gen)[: sum(blocks)]
    tables = torch.zeros(len(seq_lens), max(blocks), dtype=torch.int32)
    slots, first = [], 0
    for i, (q_len, n) in enumerate(zip(query_lens, seq_lens, strict=True)):
        tables[i, : blocks[i]] = order[first : first + blocks[i]]
        first += blocks[i]
        slots += [int(tables[i, p // BLOCK]) * BLOCK + p % BLOCK for p in range(n - q_len, n)]
    cache = torch.randn(2, num_blocks, BLOCK, kv_heads, 64, generator=gen)
    if dtype != FP8:
        cache = cache.to(dtype)
    else:
        cache = (cache * 4).clamp(-448, 448).to(FP8)
    starts = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    meta = AttentionMetadata(
        query_start_loc=starts,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=tables,
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        query_lens_cpu=query_lens,
        seq_lens_cpu=seq_lens,
    )
    return meta, cache, gen


def _reference(q, k, v, cache, meta, scale, window, scales):  # type: ignore[no-untyped-def]
    write_kv_cache(k, v, cache, meta.slot_mapping, scales)
    out, start = [], 0
    for i, (q_len, n) in enumerate(zip(meta.query_lens_cpu, meta.seq_lens_cpu, strict=True)):
        ctx_k, ctx_v = gather_context(cache, meta.block_tables[i], n, scales)
        out.append(attend(q[start : start + q_len], ctx_k, ctx_v, scale, True, window))
        start += q_len
    return torch.cat(out)


@pytest.mark.parametrize(
    ("query_lens", "seq_lens", "heads", "kv_heads", "window"),
    [
        ([1], [1], 4, 4, None),  # a first decode right after a one-token prompt
        ([1] * 6, [5, 17, 16, 33, 1, 130], 9, 3, None),  # odd lengths, block boundaries, GQA
        ([1] * 4, [40, 7, 64, 65], 8, 2, 9),  # sliding window
        ([1, 12, 1, 5, 1], [20, 12, 48, 30, 3], 4, 2, None),  # prompt chunks among decodes
        ([7, 1, 3], [7, 50, 19], 6, 3, 16),
        ([9, 4], [9, 20], 4, 4, None),  # no decodes at all
        ([16, 16, 16], [16, 16, 16], 9, 3, None),  # fresh prompts of one length: views
        ([40, 3, 25, 1, 6], [40, 3, 25, 30, 6], 8, 4, 8),  # fresh prompts past the window
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, FP8])
@pytest.mark.parametrize("c_library", [True, False])
def test_decode_path_equals_the_per_request_reference(
    query_lens: list[int],
    seq_lens: list[int],
    heads: int,
    kv_heads: int,
    window: int | None,
    dtype: torch.dtype,
    c_library: bool,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """c_library: a float32 cache's decodes read in place by the CPU's C library where it
    builds (mmserve.kernels.cpu_attention); else, and for other caches, gathered for SDPA."""
    if not c_library:
        monkeypatch.setattr(cpu_attention, "supports", lambda q, cache: False)
    elif dtype == torch.float32 and not cpu_lib.available():
        pytest.skip("the CPU library does not build here")
    meta, cache, gen = _step(query_lens, seq_lens, kv_heads, dtype)
    compute = torch.float32 if dtype == FP8 else dtype
    tokens = sum(query_lens)
    q = torch.randn(tokens, heads, 64, generator=gen).to(compute)
    k = torch.randn(tokens, kv_heads, 64, generator=gen).to(compute)
    v = torch.randn(tokens, kv_heads, 64, generator=gen).to(compute)
    scales = (0.02, 0.03) if dtype == FP8 else (1.0, 1.0)
    expected = _reference(q, k, v, cache.clone(), meta, 0.125, window, scales)
    got = TorchAttentionBackend().forward(q, k, v, cache, meta, 0.125, window, scales)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(got, expected, atol=tol, rtol=tol)
    # the plan kept for the next layers gives the same again
    again = TorchAttentionBackend().forward(q, k, v, cache, meta, 0.125, window, scales)
    torch.testing.assert_close(again, got, atol=0, rtol=0)


@pytest.mark.parametrize(
    ("num_q", "seq_len", "heads", "kv_heads", "causal", "window"),
    [
        (1, 1, 4, 4, True, None),
        (5, 37, 9, 3, True, None),  # a chunk after 32 cached positions, GQA
        (64, 200, 8, 2, True, 48),  # sliding window
        (17, 17, 6, 1, True, None),  # a whole prompt, one KV head (MQA)
        (7, 30, 4, 2, False, None),  # no mask at all
    ],
)
def test_attend_context_equals_the_reference(
    num_q: int, seq_len: int, heads: int, kv_heads: int, causal: bool, window: int | None
) -> None:
    """The chunk path's one scaled_dot_product_attention (GQA heads folded into query rows)
    computes attend()'s einsums, in bfloat16 inputs too (both compute in float32)."""
    gen = torch.Generator().manual_seed(num_q * 1000 + seq_len)
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 1e-2)):
        q = torch.randn(num_q, heads, 64, generator=gen).to(dtype)
        k = torch.randn(seq_len, kv_heads, 64, generator=gen).to(dtype)
        v = torch.randn(seq_len, kv_heads, 64, generator=gen).to(dtype)
        got = attend_context(q, k, v, 0.125, causal, window)
        assert got.dtype == dtype and got.shape == q.shape
        torch.testing.assert_close(got, attend(q, k, v, 0.125, causal, window), atol=tol, rtol=tol)
