"""A one-layer causal model over the paged KV cache, for fast engine tests.

It runs real attention through the torch reference backend, so a wrong slot mapping, block
table or position shows up as a different token; `reference_greedy` computes the same model
without any cache, the oracle for chunking, batching, preemption and prefix caching."""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from mmserve.attention import AttentionMetadata
from mmserve.attention.torch_ref import TorchAttentionBackend
from mmserve.kernels.paged_ref import attend
from mmserve.models.base import ModelBase, ModelCapabilities


class FakeModel(ModelBase):
    capabilities: ClassVar[ModelCapabilities] = ModelCapabilities()  # a plain decoder
    num_layers = 1
    num_kv_heads = 2
    head_dim = 8
    hidden_size = num_kv_heads * 2 * head_dim  # q has twice the KV heads

    def __init__(self, vocab_size: int = 64, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.vocab_size = vocab_size
        hidden = self.hidden_size
        self.embed = nn.Embedding(vocab_size, hidden)
        self.pos = nn.Embedding(4096, hidden)
        self.q = nn.Linear(hidden, hidden)
        self.kv = nn.Linear(hidden, 2 * self.num_kv_heads * self.head_dim)
        self.head = nn.Linear(hidden, vocab_size)
        for p in self.parameters():
            nn.init.normal_(p, std=1.0)
        self.backend = TorchAttentionBackend()

    def _qkv(self, ids: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, ...]:
        x = self.embed(ids) + self.pos(pos)
        q = self.q(x).view(-1, 2 * self.num_kv_heads, self.head_dim)
        k, v = self.kv(x).view(-1, 2, self.num_kv_heads, self.head_dim).unbind(1)
        return x, q, k, v

    def forward(self, input_ids, positions, kv_caches, meta: AttentionMetadata):  # type: ignore[no-untyped-def]
        x, q, k, v = self._qkv(input_ids, positions)
        o = self.backend.forward(q, k, v, kv_caches[0], meta, scale=0.3)
        return x + o.flatten(1)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head(hidden).float()

    def load_weights(self, weights) -> None:  # type: ignore[no-untyped-def]
        raise NotImplementedError

    @torch.inference_mode()
    def reference_hidden(self, prompt: list[int]) -> torch.Tensor:
        """Final hidden states of every prompt token, computed without any cache: [T, H]."""
        x, q, k, v = self._qkv(torch.tensor(prompt), torch.arange(len(prompt)))
        return x + attend(q, k, v, 0.3, causal=True, sliding_window=None).flatten(1)

    @torch.inference_mode()
    def reference_greedy(self, prompt: list[int], max_tokens: int) -> list[int]:
        """Greedy decoding with full recomputation and no cache."""
        ids = list(prompt)
        for _ in range(max_tokens):
            t = torch.tensor(ids)
            x, q, k, v = self._qkv(t, torch.arange(len(ids)))
            o = attend(q, k, v, 0.3, causal=True, sliding_window=None)
            logits = self.compute_logits((x + o.flatten(1))[-1:])
            ids.append(int(logits.argmax()))
        return ids[len(prompt) :]
