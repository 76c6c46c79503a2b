"""LlamaModel, MistralModel, Qwen2Model and Qwen3Model checkpoints: the decoder of llama.py
alone, without a language-model head, as embedding models ship it (e5-mistral-7b-instruct,
SFR-Embedding-Mistral, Linq-Embed-Mistral). Their weights are named as the bare decoder's
("layers.0...", no "model." prefix; llama.backbone_name maps them)."""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from mmserve.attention import AttentionBackend
from mmserve.models.base import ModelCapabilities
from mmserve.models.llama import LlamaForCausalLM


class LlamaEmbeddingModel(LlamaForCausalLM):
    """Final hidden states for pooling (last token unless sentence-transformers files say
    otherwise); runs through the paged KV cache like the causal LM, but cannot generate."""

    capabilities: ClassVar[ModelCapabilities] = ModelCapabilities(
        embeds_only=True, supports_fp8=True, tensor_parallel=True
    )

    def __init__(self, hf_config: Any, attention_backend: AttentionBackend) -> None:
        super().__init__(hf_config, attention_backend)
        del self.lm_head  # the checkpoint has none

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        raise RuntimeError(f"{type(self).__name__} has no language-model head; it cannot generate")
