"""SigLIP: the vision tower (also a LLaVA tower), and the dual encoder that embeds images and
texts into one space (transformers' SiglipModel get_image_features / get_text_features)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import nn

from mmserve.attention import AttentionBackend, AttentionMetadata
from mmserve.errors import UnsupportedModel
from mmserve.models.vision import (
    MLP,
    Encoder,
    TextTransformer,
    check_image_size,
    encoder_spec,
    hidden_state_index,
    is_buffer_name,
    load_by_name,
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


class SiglipVisionTower(nn.Module):
    """SiglipVisionModel, built up to the deepest hidden state its owner reads.

    num_layers: encoder layers to build (default all); with_pool: also post_layernorm and the
    attention-pooling head, for the pooled output (LLaVA reads hidden states only)."""

    has_class_token = False

    def __init__(self, config: Any, num_layers: int | None = None, with_pool: bool = True) -> None:
        super().__init__()
        spec = encoder_spec(config)
        if with_pool and not getattr(config, "vision_use_head", True):
            raise UnsupportedModel("SigLIP vision tower without its pooling head (vision_use_head)")
        self.total_layers = spec.num_layers
        self.image_size: int = config.image_size
        self.patch_size: int = config.patch_size
        self.embeddings = SiglipVisionEmbeddings(config)
        self.encoder = Encoder(spec, spec.num_layers if num_layers is None else num_layers)
        self.with_pool = with_pool
        if with_pool:
            self.post_layernorm = nn.LayerNorm(spec.hidden_size, eps=spec.layer_norm_eps)
            self.head = SiglipAttentionPoolingHead(config)

    def num_tokens(self, height: int, width: int) -> int:
        """Rows of each hidden state for one image: one per patch."""
        return (height // self.patch_size) * (width // self.patch_size)

    def hidden_states(
        self, pixel_values: torch.Tensor, indices: Sequence[int]
    ) -> list[torch.Tensor]:
        """transformers' output_hidden_states[i] for each i (negative counts from the end of
        the full tower's states; the last is before post_layernorm): [B, N, hidden] each."""
        check_image_size(pixel_values, self.image_size)
        resolved = [hidden_state_index(i, self.total_layers) for i in indices]
        _, kept = self.encoder(self.embeddings(pixel_values), keep=frozenset(resolved))
        return [kept[i] for i in resolved]

    def pooled(self, pixel_values: torch.Tensor) -> torch.Tensor:  # -> [B, hidden]
        (last,) = self.hidden_states(pixel_values, [-1])
        return self.head(self.post_layernorm(last))

    def param_name(self, name: str) -> str | None:
        """Checkpoint name inside the tower -> parameter name; None for weights of parts
        not built (layers past the deepest read, the pooling norm and head)."""
        if name.startswith("encoder.layers."):
            layer = int(name.split(".")[2])
            if layer >= len(self.encoder.layers):
                return None
        if name.startswith(("post_layernorm.", "head.")) and not self.with_pool:
            return None
        return name


class SiglipTextTransformer(TextTransformer):
    """Bidirectional text encoder + the linear head applied to the pooled (last) token."""

    def __init__(self, config: Any) -> None:
        super().__init__(config, causal=False)
        projection = getattr(config, "projection_size", None) or config.hidden_size
        self.head = nn.Linear(config.hidden_size, projection)


class SiglipModel(nn.Module):
    """The SigLIP dual encoder for embeddings. forward() runs the text tower over a flat batch
    of whole texts (no KV cache); pool_text() and embed_images() give the vectors
    transformers' get_text_features / get_image_features give (unnormalised).

    SigLIP was trained on texts padded to 64 tokens (its processor pads to max_length), and
    pools the last position: a text matches transformers' padded output only if its ids
    include that padding."""

    num_layers = 0  # no KV cache
    uses_kv_cache = False
    causal = False
    is_dual_encoder = True

    def __init__(self, hf_config: Any, attention_backend: AttentionBackend | None = None) -> None:
        super().__init__()
        text, vision = hf_config.text_config, hf_config.vision_config
        self.num_kv_heads = text.num_attention_heads
        self.head_dim = text.hidden_size // text.num_attention_heads
        self.hidden_size: int = vision.hidden_size  # the embedding's size
        self.vocab_size: int = text.vocab_size
        self.max_text_len: int = text.max_position_embeddings
        # Embed pads each text to this many tokens with pad_token_id, as SigLIP's processor
        # does (padding="max_length"): the last position is what it pools
        self.pad_text_to: int = self.max_text_len
        pad = getattr(text, "pad_token_id", None)
        self.pad_token_id: int = 1 if pad is None else int(pad)  # the tokenizer's wins
        self.text_model = SiglipTextTransformer(text)
        if self.text_model.head.out_features != self.hidden_size:
            raise UnsupportedModel("SigLIP text projection_size != vision hidden_size")
        self.vision_model = SiglipVisionTower(vision)

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64, whole texts back to back
        positions: torch.Tensor,  # [T] int64, 0..n-1 within each text
        kv_caches: list[torch.Tensor],  # unused
        meta: AttentionMetadata,  # query_start_loc / query_lens_cpu delimit the texts
    ) -> torch.Tensor:  # [T, text hidden]
        return self.text_model(input_ids, positions, meta)

    def pool_text(self, hidden_rows: torch.Tensor, input_ids: list[int]) -> torch.Tensor:
        """One text's rows [n, text hidden] -> its embedding [hidden_size] (float32): the
        head over the last token."""
        return self.text_model.head(hidden_rows[-1]).float()

    def embed_images(self, pixel_values: torch.Tensor) -> torch.Tensor:  # [B,3,H,W] -> [B, h]
        weight = self.vision_model.embeddings.patch_embedding.weight
        return self.vision_model.pooled(pixel_values.to(weight.device, weight.dtype)).float()

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("SiglipModel has no language-model head; it cannot generate")

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        load_by_name(self, weights, _param_name)


def _param_name(name: str) -> str | None:
    if is_buffer_name(name) or name in ("logit_scale", "logit_bias"):  # similarity scores only
        return None
    return name
