"""Poolers: one input's hidden states -> an embedding, label scores or a score."""

from __future__ import annotations

from typing import Protocol

import torch

from mmserve.params import PoolingParams


class Pooler(Protocol):
    """Called once per pooling request, with the final hidden states of all its tokens
    ([num_tokens, hidden_size], in order); returns a 1-D result."""

    def __call__(self, hidden: torch.Tensor, params: PoolingParams) -> torch.Tensor: ...
