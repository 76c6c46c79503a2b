"""LLaVA: a CLIP or SigLIP vision tower, a two-layer projector, and a Llama-family decoder
(mmserve.models.llama) that reads the projected image rows in place of placeholder tokens.

Checkpoint names: transformers 5 names parameters model.vision_tower.*,
model.multi_modal_projector.*, model.language_model.* and lm_head.weight, but its
save_pretrained (and the hub's llava-hf checkpoints) write the legacy layout vision_tower.*
(hub: vision_tower.vision_model.*), multi_modal_projector.*, language_model.model.* and
language_model.lm_head.weight. load_weights() takes all of these.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any, ClassVar

import torch
from torch import nn

from mmserve.attention import AttentionBackend
from mmserve.errors import UnsupportedModel
from mmserve.models.base import (
    ImageTokenCount,
    LanguageModelWrapper,
    ModelBase,
    ModelCapabilities,
)
from mmserve.models.clip import CLIPVisionTower
from mmserve.models.llama import LlamaForCausalLM
from mmserve.models.siglip import SiglipVisionTower
from mmserve.models.vision import hidden_state_index, is_buffer_name, load_by_name

# vision_config.model_type -> tower class
_TOWERS: dict[str, type[CLIPVisionTower | SiglipVisionTower]] = {
    "clip_vision_model": CLIPVisionTower,
    "siglip_vision_model": SiglipVisionTower,
}
_STRATEGIES = ("default", "full")  # default: drop each image's first row (CLIP's CLS)


class LlavaMultiModalProjector(nn.Module):
    def __init__(self, config: Any, in_features: int) -> None:
        super().__init__()
        from transformers.activations import ACT2FN

        hidden, bias = config.text_config.hidden_size, config.multimodal_projector_bias
        self.linear_1 = nn.Linear(in_features, hidden, bias=bias)
        self.act = ACT2FN[config.projector_hidden_act]
        self.linear_2 = nn.Linear(hidden, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(x)))


class LlavaForConditionalGeneration(LanguageModelWrapper, ModelBase):
    """The MultiModalCausalLM and Fp8Model (mmserve.models.base) for LLaVA-1.5-style
    checkpoints; fp8 swaps its language model's projections."""

    capabilities: ClassVar[ModelCapabilities] = ModelCapabilities(
        reads_images=True, supports_fp8=True, tensor_parallel=True
    )

    def __init__(self, hf_config: Any, attention_backend: AttentionBackend) -> None:
        super().__init__()
        vision = hf_config.vision_config
        if vision.model_type not in _TOWERS:
            raise UnsupportedModel(
                f"LLaVA vision tower {vision.model_type!r}; supported: {sorted(_TOWERS)}"
            )
        strategy = hf_config.vision_feature_select_strategy
        if strategy not in _STRATEGIES:
            raise UnsupportedModel(f"vision_feature_select_strategy {strategy!r}")
        self.drop_first_row = strategy == "default"
        layers = hf_config.vision_feature_layer
        self.feature_layers = [layers] if isinstance(layers, int) else list(layers)
        depth = max(hidden_state_index(i, vision.num_hidden_layers) for i in self.feature_layers)
        self.vision_tower = _TOWERS[vision.model_type](vision, num_layers=depth, with_pool=False)
        in_features = vision.hidden_size * len(self.feature_layers)
        self.multi_modal_projector = LlavaMultiModalProjector(hf_config, in_features)
        self.language_model = LlamaForCausalLM(hf_config.text_config, attention_backend)
        self.image_token_id = hf_config.image_token_id
        size = self.vision_tower.image_size  # the processor resizes every image to it
        per_image = self.vision_tower.num_tokens(size, size) - int(self.drop_first_row)
        self.image_tokens = ImageTokenCount(per_image=per_image, image_size=size)
        lm = self.language_model
        self.num_layers, self.num_kv_heads = lm.num_layers, lm.num_kv_heads
        self.head_dim, self.vocab_size, self.hidden_size = (
            lm.head_dim,
            lm.vocab_size,
            lm.hidden_size,
        )
        self.sliding_windows = lm.sliding_windows

    def num_image_tokens(self, data: Mapping[str, torch.Tensor]) -> int:
        return self.image_tokens.count(data)

    def encode_images(self, data: list[Mapping[str, torch.Tensor]]) -> list[torch.Tensor]:
        """Images of one size run as one batch; one [num_image_tokens, hidden] each, in order."""
        weight = self.multi_modal_projector.linear_1.weight
        out: dict[int, torch.Tensor] = {}  # image index -> its rows
        by_shape: dict[tuple[int, ...], list[int]] = {}
        for i, d in enumerate(data):
            by_shape.setdefault(tuple(d["pixel_values"].shape[1:]), []).append(i)
        for indices in by_shape.values():
            pixels = torch.cat([data[i]["pixel_values"] for i in indices])
            features = self._image_features(pixels.to(weight.device, weight.dtype))
            for i, rows in zip(indices, features, strict=True):
                out[i] = rows
        return [out[i] for i in range(len(data))]

    def _image_features(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[B, 3, H, W] -> [B, num_image_tokens, text hidden]."""
        states = self.vision_tower.hidden_states(pixel_values, self.feature_layers)
        if self.drop_first_row:
            states = [s[:, 1:] for s in states]
        return self.multi_modal_projector(torch.cat(states, dim=-1))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Streams language-model tensors into LlamaForCausalLM.load_weights and the others
        into the tower and projector; either side raises on a missing or unknown weight."""
        others: list[tuple[str, torch.Tensor]] = []
        self.language_model.load_weights(_language_model_weights(weights, others))
        load_by_name(
            nn.ModuleDict(
                {"vision_tower": self.vision_tower, "projector": self.multi_modal_projector}
            ),
            others,
            self._param_name,
        )

    def _param_name(self, name: str) -> str | None:
        """A non-LM checkpoint name -> "vision_tower.*" / "projector.*", None if dropped."""
        if is_buffer_name(name):
            return None
        if name.startswith("multi_modal_projector."):
            return "projector." + name.removeprefix("multi_modal_projector.")
        if name.startswith("vision_tower."):
            inner = name.removeprefix("vision_tower.").removeprefix("vision_model.")
            kept = self.vision_tower.param_name(inner)
            return None if kept is None else f"vision_tower.{kept}"
        return name  # unknown: load_by_name raises naming it


def _language_model_weights(
    weights: Iterable[tuple[str, torch.Tensor]], others: list[tuple[str, torch.Tensor]]
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yields the decoder's tensors under LlamaForCausalLM's names (model.*, lm_head.weight);
    appends every other (name without the leading "model.", tensor) to others."""
    for name, tensor in weights:
        if name.startswith("language_model.model."):  # legacy layout
            yield name.removeprefix("language_model."), tensor
        elif name in ("language_model.lm_head.weight", "lm_head.weight"):
            yield "lm_head.weight", tensor
        elif name.startswith("model.language_model."):
            yield "model." + name.removeprefix("model.language_model."), tensor
        else:
            others.append((name.removeprefix("model."), tensor))
