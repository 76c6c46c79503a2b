"""CLIP: the vision tower (also LLaVA's), and the dual encoder that embeds images and texts
into one space (transformers' CLIPModel get_image_features / get_text_features)."""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import nn

from mmserve.attention import AttentionBackend
from mmserve.models.base import ModelCapabilities
from mmserve.models.vision import DUAL_ENCODER, DualEncoder, TextTransformer, VisionTower


class CLIPVisionEmbeddings(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        hidden, patch = config.hidden_size, config.patch_size
        self.class_embedding = nn.Parameter(torch.empty(hidden))
        self.patch_embedding = nn.Conv2d(3, hidden, kernel_size=patch, stride=patch, bias=False)
        num_positions = (config.image_size // patch) ** 2 + 1
        self.position_embedding = nn.Embedding(num_positions, hidden)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:  # [B, 3, H, W] -> [B, N+1, h]
        dtype = self.patch_embedding.weight.dtype
        patches = self.patch_embedding(pixel_values.to(dtype)).flatten(2).transpose(1, 2)
        cls = self.class_embedding.expand(patches.shape[0], 1, -1)
        return torch.cat([cls, patches], dim=1) + self.position_embedding.weight


class CLIPVisionTower(VisionTower):
    """CLIPVisionModel: the class token and pre-norm before the encoder; pooled output is
    post_layernorm of the last layer's class token (CLIPVisionModel's pooler_output)."""

    has_class_token = True
    pool_parts = ("post_layernorm.",)

    def __init__(self, config: Any, num_layers: int | None = None, with_pool: bool = True) -> None:
        super().__init__(config, num_layers, with_pool)
        self.embeddings = CLIPVisionEmbeddings(config)
        self.pre_layrnorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def embed(self, pixel_values: torch.Tensor) -> torch.Tensor:  # -> [B, N+1, hidden]
        return self.pre_layrnorm(self.embeddings(pixel_values))  # type: ignore[no-any-return]

    def pooled(self, pixel_values: torch.Tensor) -> torch.Tensor:  # -> [B, hidden]
        (last,) = self.hidden_states(pixel_values, [-1])
        return self.post_layernorm(last[:, 0])  # type: ignore[no-any-return]


class CLIPModel(DualEncoder):
    """The CLIP dual encoder for embeddings. forward() runs the text tower over a flat batch
    of whole texts (no KV cache); pool_text() and embed_images() give the projected vectors
    transformers' get_text_features / get_image_features give (unnormalised)."""

    capabilities: ClassVar[ModelCapabilities] = DUAL_ENCODER
    dropped_weights = ("logit_scale",)  # similarity scores only

    def __init__(self, hf_config: Any, attention_backend: AttentionBackend | None = None) -> None:
        super().__init__(hf_config)
        text, vision = hf_config.text_config, hf_config.vision_config
        self.hidden_size = hf_config.projection_dim  # the embedding's size
        self.eos_token_id: int | None = text.eos_token_id
        self.text_model = TextTransformer(text, causal=True)
        self.vision_model = CLIPVisionTower(vision)
        self.text_projection = nn.Linear(text.hidden_size, self.hidden_size, bias=False)
        self.visual_projection = nn.Linear(vision.hidden_size, self.hidden_size, bias=False)

    def pool_text(self, hidden_rows: torch.Tensor, input_ids: list[int]) -> torch.Tensor:
        """One text's rows [n, text hidden] -> its embedding [projection_dim] (float32), read
        at the end-of-text token as transformers picks it."""
        if self.eos_token_id == 2:  # legacy configs: the end-of-text token has the largest id
            index = input_ids.index(max(input_ids))
        elif self.eos_token_id in input_ids:
            index = input_ids.index(self.eos_token_id)
        else:  # no eos: transformers' argmax over all-False reads position 0
            index = 0
        return self.text_projection(hidden_rows[index]).float()  # type: ignore[no-any-return]

    def embed_images(self, pixel_values: torch.Tensor) -> torch.Tensor:  # [B,3,H,W] -> [B, P]
        device, dtype = self.visual_projection.weight.device, self.visual_projection.weight.dtype
        pooled = self.vision_model.pooled(pixel_values.to(device, dtype))
        return self.visual_projection(pooled).float()  # type: ignore[no-any-return]
