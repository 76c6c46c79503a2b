"""The batched encoder path of the torch attention backend (kv_cache None) equals the
per-request reference attend() on random inputs: padding, grouping, GQA, masks."""

from __future__ import annotations

from itertools import accumulate

import pytest
import torch

from mmserve.attention.backend import AttentionMetadata
from mmserve.attention.torch_ref import TorchAttentionBackend, length_groups
from mmserve.kernels.paged_ref import attend


def _meta(lengths: list[int], causal: bool) -> AttentionMetadata:
    starts = torch.tensor(list(accumulate(lengths, initial=0)), dtype=torch.int32)
    return AttentionMetadata(
        query_start_loc=starts,
        seq_lens=torch.tensor(lengths, dtype=torch.int32),
        block_tables=torch.zeros(len(lengths), 1, dtype=torch.int32),
        slot_mapping=torch.full((sum(lengths),), -1, dtype=torch.int64),
        max_query_len=max(lengths),
        max_seq_len=max(lengths),
        query_lens_cpu=lengths,
        seq_lens_cpu=lengths,
        causal=causal,
    )


def _reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    lengths: list[int],
    scale: float,
    causal: bool,
    window: int | None,
) -> torch.Tensor:
    out, start = [], 0
    for n in lengths:
        rows = slice(start, start + n)
        out.append(attend(q[rows], k[rows], v[rows], scale, causal, window))
        start += n
    return torch.cat(out)


@pytest.mark.parametrize(
    ("lengths", "heads", "kv_heads", "causal", "window"),
    [
        ([7, 1, 33, 16, 64, 3, 40, 2], 4, 4, False, None),  # several padded groups
        ([12, 12, 12], 4, 4, False, None),  # equal lengths: the copy-free path
        ([5, 20, 9, 17], 8, 2, False, None),  # grouped-query attention
        ([5, 20, 9, 17], 4, 4, True, None),
        ([30, 8, 30, 1], 4, 2, True, 6),
        ([1], 2, 2, False, None),
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_encoder_path_equals_the_per_request_reference(
    lengths: list[int],
    heads: int,
    kv_heads: int,
    causal: bool,
    window: int | None,
    dtype: torch.dtype,
) -> None:
    gen = torch.Generator().manual_seed(sum(lengths) + heads)
    tokens, dim = sum(lengths), 16
    # q, k, v as the models make them: strided views of one merged projection
    qkv = (2 * torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=gen)).to(dtype)
    q, k, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    q, k, v = (
        q.view(tokens, heads, dim),
        k.view(tokens, kv_heads, dim),
        v.view(tokens, kv_heads, dim),
    )
    out = TorchAttentionBackend().forward(q, k, v, None, _meta(lengths, causal), 0.3, window)
    expected = _reference(q, k, v, lengths, 0.3, causal, window)
    assert out.dtype == dtype and out.shape == q.shape
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out, expected, atol=tol, rtol=tol)


def test_length_groups_bound_the_padding() -> None:
    lengths = [3, 100, 51, 50, 1, 26, 100, 7]
    groups = length_groups(lengths)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    assert groups[0] == [1, 6, 2]  # longest first, stable; 50 is not more than half of 100
    for group in groups:
        longest = lengths[group[0]]
        assert all(2 * lengths[i] > longest for i in group)
        assert all(lengths[i] <= longest for i in group)
