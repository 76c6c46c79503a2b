"""SigLIP: the vision tower (also a LLaVA tower), and the dual encoder that embeds images and
texts into one space (transformers' SiglipModel get_image_features / get_text_features)."""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import nn

from mmserve.attention import AttentionBackend
from mmserve.errors import UnsupportedModel
from mmserve.models.base import ModelCapabilities
from mmserve.models.vision import (
    DUAL_ENCODER,
    MLP,
    DualEncoder,
    TextTransformer,
    VisionTower,
    encoder_spec,
)


class SiglipVisionEmbeddings(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        hidden, patch = config.hidden_size, config.patch_size
        self.patch_embedding = nn.Conv2d(3, hidden, kernel_size=patch, stride=patch)
        self.position_embedding = nn.Embedding((config.image_size // patch) ** 2, hidden)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:  # [B, 3, H, W] -> [B, N, h]
        dtype = self.patch_embedding.weight.dtype
        patches = self.patch_embedding(pixel_values.to(dtype)).flatten(2).transpose(1, 2)
        return patches + self.position_embedding.weight


class SiglipAttentionPoolingHead(nn.Module):
    """A learned probe attends over all patches (torch's MultiheadAttention, as transformers
    uses it), then a residual MLP: [B, N, hidden] -> [B, hidden]."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.probe = nn.Parameter(torch.empty(1, 1, hidden))
        self.attention = nn.MultiheadAttention(hidden, config.num_attention_heads, batch_first=True)
        self.layernorm = nn.LayerNorm(hidden, eps=config.layer_norm_eps)
        self.mlp = MLP(encoder_spec(config))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probe = self.probe.expand(x.shape[0], 1, -1)
        x = self.attention(probe, x, x, need_weights=False)[0]
        return (x + self.mlp(self.layernorm(x)))[:, 0]


class SiglipVisionTower(VisionTower):
    """SiglipVisionModel: patches only; pooled output is the attention-pooling head over
    post_layernorm of the last layer."""

    has_class_token = False
    pool_parts = ("post_layernorm.", "head.")

    def __init__(self, config: Any, num_layers: int | None = None, with_pool: bool = True) -> None:
        if with_pool and not getattr(config, "vision_use_head", True):
            raise UnsupportedModel("SigLIP vision tower without its pooling head (vision_use_head)")
        super().__init__(config, num_layers, with_pool)
        self.embeddings = SiglipVisionEmbeddings(config)
        if with_pool:
            self.head = SiglipAttentionPoolingHead(config)

    def embed(self, pixel_values: torch.Tensor) -> torch.Tensor:  # -> [B, N, hidden]
        return self.embeddings(pixel_values)  # type: ignore[no-any-return]

    def pooled(self, pixel_values: torch.Tensor) -> torch.Tensor:  # -> [B, hidden]
        (last,) = self.hidden_states(pixel_values, [-1])
        return self.head(self.post_layernorm(last))  # type: ignore[no-any-return]


class SiglipTextTransformer(TextTransformer):
    """Bidirectional text encoder + the linear head applied to the pooled (last) token."""

    def __init__(self, config: Any) -> None:
        super().__init__(config, causal=False)
        projection = getattr(config, "projection_size", None) or config.hidden_size
        self.head = nn.Linear(config.hidden_size, projection)


class SiglipModel(DualEncoder):
    """The SigLIP dual encoder for embeddings. forward() runs the text tower over a flat batch
    of whole texts (no KV cache); pool_text() and embed_images() give the vectors
    transformers' get_text_features / get_image_features give (unnormalised).

    SigLIP was trained on texts padded to 64 tokens (its processor pads to max_length), and
    pools the last position: a text matches transformers' padded output only if its ids
    include that padding."""

    capabilities: ClassVar[ModelCapabilities] = DUAL_ENCODER
    dropped_weights = ("logit_scale", "logit_bias")  # similarity scores only
    text_model: SiglipTextTransformer

    def __init__(self, hf_config: Any, attention_backend: AttentionBackend | None = None) -> None:
        super().__init__(hf_config)
        text, vision = hf_config.text_config, hf_config.vision_config
        self.hidden_size = vision.hidden_size  # the embedding's size
        # Embed pads each text to this many tokens with pad_token_id, as SigLIP's processor
        # does (padding="max_length"): the last position is what it pools
        self.pad_text_to = self.max_text_len
        pad = getattr(text, "pad_token_id", None)
        self.pad_token_id = 1 if pad is None else int(pad)  # the tokenizer's wins
        self.text_model = SiglipTextTransformer(text)
        if self.text_model.head.out_features != self.hidden_size:
            raise UnsupportedModel("SigLIP text projection_size != vision hidden_size")
        self.vision_model = SiglipVisionTower(vision)

    def pool_text(self, hidden_rows: torch.Tensor, input_ids: list[int]) -> torch.Tensor:
        """One text's rows [n, text hidden] -> its embedding [hidden_size] (float32): the
        head over the last token."""
        return self.text_model.head(hidden_rows[-1]).float()

    def embed_images(self, pixel_values: torch.Tensor) -> torch.Tensor:  # [B,3,H,W] -> [B, h]
        weight = self.vision_model.embeddings.patch_embedding.weight
        return self.vision_model.pooled(pixel_values.to(weight.device, weight.dtype)).float()
