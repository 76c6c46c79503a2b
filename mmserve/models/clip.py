"""CLIP: the vision tower (also LLaVA's), and the dual encoder that embeds images and texts
into one space (transformers' CLIPModel get_image_features / get_text_features)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import nn

from mmserve.attention import AttentionBackend, AttentionMetadata
from mmserve.models.vision import (
    Encoder,
    TextTransformer,
    check_image_size,
    encoder_spec,
    hidden_state_index,
    is_buffer_name,
    load_by_name,
)


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


class CLIPVisionTower(nn.Module):
    """CLIPVisionModel, built up to the deepest hidden state its owner reads.

    num_layers: encoder layers to build (default all); with_pool: also post_layernorm, for the
    pooled CLS output (LLaVA reads hidden states only)."""

    has_class_token = True

    def __init__(self, config: Any, num_layers: int | None = None, with_pool: bool = True) -> None:
        super().__init__()
        spec = encoder_spec(config)
        self.total_layers = spec.num_layers
        self.image_size: int = config.image_size
        self.patch_size: int = config.patch_size
        self.embeddings = CLIPVisionEmbeddings(config)
        self.pre_layrnorm = nn.LayerNorm(spec.hidden_size, eps=spec.layer_norm_eps)
        self.encoder = Encoder(spec, spec.num_layers if num_layers is None else num_layers)
        self.with_pool = with_pool
        if with_pool:
            self.post_layernorm = nn.LayerNorm(spec.hidden_size, eps=spec.layer_norm_eps)

    def num_tokens(self, height: int, width: int) -> int:
        """Rows of each hidden state for one image: the CLS token and one per patch."""
        return (height // self.patch_size) * (width // self.patch_size) + 1

    def hidden_states(
        self, pixel_values: torch.Tensor, indices: Sequence[int]
    ) -> list[torch.Tensor]:
        """transformers' output_hidden_states[i] for each i (negative counts from the end of
        the full tower's states): [B, N+1, hidden] each."""
        check_image_size(pixel_values, self.image_size)
        resolved = [hidden_state_index(i, self.total_layers) for i in indices]
        x = self.pre_layrnorm(self.embeddings(pixel_values))
        _, kept = self.encoder(x, keep=frozenset(resolved))
        return [kept[i] for i in resolved]

    def pooled(self, pixel_values: torch.Tensor) -> torch.Tensor:  # -> [B, hidden]
        """post_layernorm of the last layer's CLS token (CLIPVisionModel's pooler_output)."""
        (last,) = self.hidden_states(pixel_values, [-1])
        return self.post_layernorm(last[:, 0])

    def param_name(self, name: str) -> str | None:
        """Checkpoint name inside the tower -> parameter name; None for weights of parts
        not built (layers past the deepest read, the pooling norm)."""
        if name.startswith("encoder.layers."):
            layer = int(name.split(".")[2])
            if layer >= len(self.encoder.layers):
                return None
        if name.startswith("post_layernorm.") and not self.with_pool:
            return None
        return name


class CLIPModel(nn.Module):
    """The CLIP dual encoder for embeddings. forward() runs the text tower over a flat batch
    of whole texts (no KV cache); pool_text() and embed_images() give the projected vectors
    transformers' get_text_features / get_image_features give (unnormalised)."""

    num_layers = 0  # no KV cache
    uses_kv_cache = False
    causal = False  # for the engine: whole inputs in one step (the tower masks causally)
    is_dual_encoder = True

    def __init__(self, hf_config: Any, attention_backend: AttentionBackend | None = None) -> None:
        super().__init__()
        text, vision = hf_config.text_config, hf_config.vision_config
        self.num_kv_heads = text.num_attention_heads
        self.head_dim = text.hidden_size // text.num_attention_heads
        self.hidden_size: int = hf_config.projection_dim  # the embedding's size
        self.vocab_size: int = text.vocab_size
        self.max_text_len: int = text.max_position_embeddings
        self.eos_token_id: int | None = text.eos_token_id
        self.text_model = TextTransformer(text, causal=True)
        self.vision_model = CLIPVisionTower(vision)
        self.text_projection = nn.Linear(text.hidden_size, self.hidden_size, bias=False)
        self.visual_projection = nn.Linear(vision.hidden_size, self.hidden_size, bias=False)

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64, whole texts back to back
        positions: torch.Tensor,  # [T] int64, 0..n-1 within each text
        kv_caches: list[torch.Tensor],  # unused
        meta: AttentionMetadata,  # query_start_loc / query_lens_cpu delimit the texts
    ) -> torch.Tensor:  # [T, text hidden]
        return self.text_model(input_ids, positions, meta)

    def pool_text(self, hidden_rows: torch.Tensor, input_ids: list[int]) -> torch.Tensor:
        """One text's rows [n, text hidden] -> its embedding [projection_dim] (float32), read
        at the end-of-text token as transformers picks it."""
        if self.eos_token_id == 2:  # legacy configs: the end-of-text token has the largest id
            index = input_ids.index(max(input_ids))
        elif self.eos_token_id in input_ids:
            index = input_ids.index(self.eos_token_id)
        else:  # no eos: transformers' argmax over all-False reads position 0
            index = 0
        return self.text_projection(hidden_rows[index]).float()

    def embed_images(self, pixel_values: torch.Tensor) -> torch.Tensor:  # [B,3,H,W] -> [B, P]
        device, dtype = self.visual_projection.weight.device, self.visual_projection.weight.dtype
        pooled = self.vision_model.pooled(pixel_values.to(device, dtype))
        return self.visual_projection(pooled).float()

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("CLIPModel has no language-model head; it cannot generate")

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        load_by_name(self, weights, _param_name)


def _param_name(name: str) -> str | None:
    if is_buffer_name(name) or name == "logit_scale":  # logit_scale: similarity scores only
        return None
    return name
