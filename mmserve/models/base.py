"""The interface every model implementation offers to the model runner."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

import torch

from mmserve.attention import AttentionMetadata


class CausalLM(Protocol):
    """A decoder over the paged KV cache.

    forward() runs all new tokens of all scheduled requests as one flat batch and returns
    their final hidden states (after the last norm); compute_logits() maps selected rows to
    vocabulary logits, so the runner only pays the LM head for positions that sample.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int  # logits width (may exceed the tokenizer's vocabulary when padded)

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens] int64
        positions: torch.Tensor,  # [num_tokens] int64, position of each token in its sequence
        kv_caches: list[torch.Tensor],  # one [2, num_blocks, block_size, Hkv, D] per layer
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, hidden_size]
        ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, H] -> [N, vocab] fp32
        ...

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Takes (HF parameter name, tensor) pairs; raises on a missing or unknown weight."""
        ...
