"""Batched pooling equals pooling each input alone, for every method and option."""

from __future__ import annotations

import pytest
import torch

from mmserve.params import PoolingParams
from mmserve.runner.pooler import (
    POOLING_METHODS,
    finish_embedding,
    finish_embeddings,
    pool_tokens,
    pool_tokens_batch,
)


@pytest.mark.parametrize("method", POOLING_METHODS)
@pytest.mark.parametrize("params", [PoolingParams(), PoolingParams(normalize=False, dimensions=5)])
def test_batch_equals_one_by_one(method: str, params: PoolingParams) -> None:
    gen = torch.Generator().manual_seed(0)
    lengths = [3, 1, 7, 2]
    starts = [0, 3, 4, 11]
    hidden = torch.randn(13, 8, generator=gen)
    got = finish_embeddings(pool_tokens_batch(hidden, starts, lengths, method), params)
    for i, (s, n) in enumerate(zip(starts, lengths)):
        want = finish_embedding(pool_tokens(hidden[s : s + n], method), params)
        torch.testing.assert_close(got[i], want, rtol=1e-5, atol=1e-6)
