"""The interface every model implementation offers to the model runner."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, Protocol

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


class MultiModalCausalLM(CausalLM, Protocol):
    """A CausalLM that also reads images (LLaVA, Qwen2-VL).

    Each image in a prompt is one `image_token_id` after chat-template rendering; the engine
    expands it into num_image_tokens() copies, and the runner replaces the embeddings of those
    copies with the rows encode_images() returns for the image (in order), then calls forward()
    with inputs_embeds. `data` is the model's image processor output for ONE image, as CPU
    tensors: {"pixel_values": [1, 3, H, W]} for CLIP/SigLIP-style towers, {"pixel_values":
    [patches, C*T*P*P], "image_grid_thw": [1, 3]} for Qwen2-VL.
    """

    image_token_id: int  # the placeholder token of one image in the rendered prompt
    uses_mrope: bool  # True: forward() takes positions [3, T] (see mrope_positions)

    def num_image_tokens(self, data: Mapping[str, torch.Tensor]) -> int:
        """How many placeholder tokens (and encoder rows) this one image takes."""
        ...

    def encode_images(self, data: list[Mapping[str, torch.Tensor]]) -> list[torch.Tensor]:
        """Vision tower + projector: one [num_image_tokens(d), hidden_size] tensor per image,
        in the LM's dtype on its device (inputs are moved there by the model)."""
        ...

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, hidden]
        ...

    def forward(  # type: ignore[override]
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64, or [3, T] when uses_mrope
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
        inputs_embeds: torch.Tensor | None = None,  # [T, hidden]: replaces input_ids' embeddings
    ) -> torch.Tensor:
        ...


class LanguageModelWrapper:
    """For VLMs: token embeddings, the decoder pass and the LM head are those of
    `self.language_model` (a CausalLM with embed_input_ids). Mix in before nn.Module."""

    language_model: Any

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, hidden]
        return self.language_model.embed_input_ids(input_ids)  # type: ignore[no-any-return]

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64, or [3, T] for M-RoPE models
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
        inputs_embeds: torch.Tensor | None = None,  # [T, hidden], image rows filled in
    ) -> torch.Tensor:  # [T, hidden]
        return self.language_model(input_ids, positions, kv_caches, meta, inputs_embeds)  # type: ignore[no-any-return]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.language_model.compute_logits(hidden)  # type: ignore[no-any-return]


class MRopeModel(Protocol):
    """Extra of a uses_mrope model (Qwen2-VL): positions computed once per prompt."""

    def mrope_positions(
        self, token_ids: list[int], grid_thws: list[tuple[int, int, int]]
    ) -> tuple[torch.Tensor, int]:
        """([3, len(token_ids)] int64 positions, delta) exactly as transformers' get_rope_index
        for one sequence whose images (in order) have these grids; token i >= len(token_ids)
        (a generated one) has position i + delta in all three rows."""
        ...
