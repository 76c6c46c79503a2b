"""*ForSequenceClassification on the Llama family: the decoder of llama.py with a `score`
head (no bias) read at the last token, as transformers does for unpadded inputs."""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import nn

from mmserve.attention import AttentionBackend
from mmserve.models.base import ModelCapabilities
from mmserve.models.llama import LlamaForCausalLM


class LlamaForSequenceClassification(LlamaForCausalLM):
    """Llama / Mistral / Qwen2 / Qwen3 classifiers and reward-style scorers. Runs through
    the paged KV cache like the causal LM (so prefix caching and chunking rules are the
    same), but has no language-model head: it classifies, it cannot generate. A
    ClassifierModel (mmserve.models.base); fp8 quantises its decoder as the causal LM's."""

    # the score head reads the last token, which sees the whole input
    capabilities: ClassVar[ModelCapabilities] = ModelCapabilities(
        classifier=True, default_pooling="last", supports_fp8=True, tensor_parallel=True
    )  # tensor parallel: the decoder is split as the causal LM's, the score head held whole

    def __init__(self, hf_config: Any, attention_backend: AttentionBackend) -> None:
        super().__init__(hf_config, attention_backend)
        del self.lm_head  # the checkpoint has `score` instead
        self.num_labels = hf_config.num_labels
        self.score = nn.Linear(self.spec.hidden_size, self.num_labels, bias=False)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        raise RuntimeError(f"{type(self).__name__} has no language-model head; it cannot generate")

    def compute_class_logits(self, pooled: torch.Tensor) -> torch.Tensor:
        """[N, hidden] last-token states -> [N, num_labels] float32 logits."""
        return self.score(pooled).float()
