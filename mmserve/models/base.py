"""The interface every model implementation offers to the model runner and the engine.

A model's capabilities are data declared with its class (ModelCapabilities); the optional
parts of the interface (images, M-RoPE, classifier heads, dual encoders, FP8) are small
Protocols that a capability flag selects. Nothing probes a model with getattr/hasattr.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol, runtime_checkable

import torch
from torch import nn

from mmserve.attention import AttentionMetadata
from mmserve.errors import InvalidArgument
from mmserve.inputs import grid_thw
from mmserve.models.parallel import Shard

# checkpoint names of a VLM's vision side (LLaVA, Qwen2-VL), which tensor parallelism replicates
_VISION_PARTS = ("vision_tower.", "multi_modal_projector.", "visual.")
Grid = tuple[int, int, int]  # (t, h, w) in patches, as an image processor's image_grid_thw


@dataclass(frozen=True)
class ModelCapabilities:
    """What a model class can do, declared in its body: `capabilities: ClassVar[...] = ...`."""

    causal: bool = True  # False: bidirectional attention within each input
    uses_kv_cache: bool = True  # False: encoders, each input whole in one step, no KV cache
    default_pooling: str = "last"  # embedding pooling when no sentence-transformers files say
    classifier: bool = False  # sequence-classification head: ClassifierModel
    # a decoder without its LM head (LlamaModel, MistralModel...): embeds, never generates
    embeds_only: bool = False
    dual_encoder: bool = False  # CLIP/SigLIP: embeds texts and images (DualEncoderModel)
    reads_images: bool = False  # a VLM: images in prompts (MultiModalCausalLM)
    uses_mrope: bool = False  # forward() takes [3, T] positions; MRopeModel
    supports_fp8: bool = False  # mmserve.models.fp8 may swap the decoder projections (Fp8Model)
    # shards over tensor_parallel_size ranks (mmserve.models.parallel; weight_shard says how)
    tensor_parallel: bool = False


def image_grid(data: Mapping[str, torch.Tensor], merge_size: int) -> Grid:
    """A grid tower's image (t, h, w) from image_grid_thw, checked against its pixel_values."""
    grid = data["image_grid_thw"]
    if grid.numel() != 3:
        raise InvalidArgument("image_grid_thw", f"shape {tuple(grid.shape)}, expected [1, 3]")
    t, h, w = grid_thw(data)
    if h % merge_size or w % merge_size:
        raise InvalidArgument("image_grid_thw", f"{(t, h, w)}: h, w not multiples of merge")
    if data["pixel_values"].shape[0] != t * h * w:
        raise InvalidArgument("pixel_values", f"{data['pixel_values'].shape[0]} patches != t*h*w")
    return t, h, w


@dataclass(frozen=True)
class ImageTokenCount:
    """How many placeholder tokens one image takes, as plain data: the front end applies it
    to an image processor's output without the model. Exactly one kind is set."""

    per_image: int = 0  # fixed-size towers (LLaVA): tokens per image
    image_size: int = 0  # ... whose pixel_values must be [1, 3, image_size, image_size]
    merge_size: int = 0  # grid towers (Qwen2-VL): t*h*w // merge_size**2 from image_grid_thw

    def count(self, data: Mapping[str, torch.Tensor]) -> int:
        """Tokens of ONE image; InvalidArgument naming the field for a wrong shape."""
        if self.merge_size:
            t, h, w = image_grid(data, self.merge_size)
            return t * h * w // self.merge_size**2
        pixel_values = data["pixel_values"]
        size = self.image_size
        if tuple(pixel_values.shape[-3:]) != (3, size, size):
            raise InvalidArgument(
                "pixel_values",
                f"shape {tuple(pixel_values.shape)}; expected [1, 3, {size}, {size}]",
            )
        return self.per_image


class CausalLM(Protocol):
    """Every model, as the runner and the engine see it (decoders, encoders, dual encoders).

    forward() runs all new tokens of all scheduled requests as one flat batch and returns
    their final hidden states (after the last norm); compute_logits() maps selected rows to
    vocabulary logits, so the runner only pays the LM head for positions that sample.
    """

    capabilities: ClassVar[ModelCapabilities]
    num_layers: int  # KV cache layers (0: keeps no cache)
    num_kv_heads: int
    head_dim: int
    vocab_size: int  # logits width (may exceed the tokenizer's vocabulary when padded)
    hidden_size: int  # width of forward()'s rows; a dual encoder's: its embeddings'
    max_model_len: int | None  # longest input; None = the HF config's max_position_embeddings
    type_vocab_size: int  # segment ids in [0, type_vocab_size); 1 = no segment ids
    pad_text_to: int | None  # SigLIP: texts are padded to this many tokens; None = unpadded
    pad_token_id: int | None  # the token the model pads inputs with; None = it never pads
    sliding_windows: tuple[int | None, ...]  # per layer (None = full attention); () = none
    image_token_id: int  # the placeholder of one image in prompts; -1 = reads no images
    weight_scheme: str  # a quantised checkpoint's scheme as it loaded ("w4a16-g128"; "" none)

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


class ModelBase(nn.Module):
    """The base of every model class: the CausalLM attributes most models share, at their
    defaults, so each model sets only what differs. Subclasses declare `capabilities`."""

    capabilities: ClassVar[ModelCapabilities]  # no default: each model class states its own
    num_layers: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    hidden_size: int
    max_model_len: int | None = None
    type_vocab_size: int = 1
    pad_text_to: int | None = None
    pad_token_id: int | None = None
    sliding_windows: tuple[int | None, ...] = ()
    image_token_id: int = -1
    weight_scheme: str = ""  # set by the loader (models/weight_only.py)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Models with a language-model head override this; the others cannot generate."""
        raise RuntimeError(f"{type(self).__name__} has no language-model head; it cannot generate")

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        raise NotImplementedError(f"{type(self).__name__} does not say how its weights load")

    def weight_shard(self, name: str, shape: tuple[int, ...]) -> Shard | None:
        """The part of checkpoint tensor `name` (of that shape) this rank of a tensor-parallel
        model holds; None: all of it. Models with capabilities.tensor_parallel override it."""
        return None


@runtime_checkable
class MultiModalCausalLM(CausalLM, Protocol):
    """A CausalLM with capabilities.reads_images (LLaVA, Qwen2-VL).

    Each image in a prompt is one `image_token_id` after chat-template rendering; the engine
    expands it into image_tokens.count() copies, and the runner replaces the embeddings of
    those copies with the rows encode_images() returns for the image (in order), then calls
    forward() with inputs_embeds. `data` is the model's image processor output for ONE image,
    as CPU tensors: {"pixel_values": [1, 3, H, W]} for CLIP/SigLIP-style towers,
    {"pixel_values": [patches, C*T*P*P], "image_grid_thw": [1, 3]} for Qwen2-VL.
    """

    image_tokens: ImageTokenCount  # placeholder tokens per image, without the model

    def num_image_tokens(self, data: Mapping[str, torch.Tensor]) -> int:
        """How many placeholder tokens (and encoder rows) this one image takes: exactly
        image_tokens.count(data)."""
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
        positions: torch.Tensor,  # [T] int64, or [3, T] when capabilities.uses_mrope
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
        inputs_embeds: torch.Tensor | None = None,  # [T, hidden]: replaces input_ids' embeddings
    ) -> torch.Tensor:
        ...


@runtime_checkable
class MRopeModel(Protocol):
    """Extra of a capabilities.uses_mrope model (Qwen2-VL): positions computed once per prompt."""

    def mrope_positions(
        self, token_ids: list[int], grid_thws: list[Grid]
    ) -> tuple[torch.Tensor, int]:
        """([3, len(token_ids)] int64 positions, delta) exactly as transformers' get_rope_index
        for one sequence whose images (in order) have these grids; token i >= len(token_ids)
        (a generated one) has position i + delta in all three rows."""
        ...


class ClassifierModel(CausalLM, Protocol):
    """A CausalLM with capabilities.classifier: a sequence-classification head over the
    pooled token (capabilities.default_pooling)."""

    num_labels: int

    def compute_class_logits(self, pooled: torch.Tensor) -> torch.Tensor:
        """[N, hidden] pooled states -> [N, num_labels] float32 logits."""
        ...


@runtime_checkable
class DualEncoderModel(CausalLM, Protocol):
    """A CausalLM with capabilities.dual_encoder (CLIP, SigLIP): forward() runs the text
    tower over whole texts; the runner pools each text and embeds each image itself."""

    def pool_text(self, hidden_rows: torch.Tensor, input_ids: list[int]) -> torch.Tensor:
        """One text's final rows [n, text hidden] (and its ids) -> its embedding (float32)."""
        ...

    def embed_images(self, pixel_values: torch.Tensor) -> torch.Tensor:  # [B,3,H,W] -> [B, D]
        """The images' embeddings (float32, unnormalised)."""
        ...


class Fp8Model(Protocol):
    """Extra of a capabilities.supports_fp8 model: the decoder layers whose nn.Linear
    projections mmserve.models.fp8 replaces (a VLM's language model's)."""

    def decoder_layers(self) -> nn.ModuleList: ...

    def fuse_input_quant(self) -> None:
        """After the projections are swapped: each norm or activation that feeds a w8a8
        projection hands it its input quantised, per models/quantized_input.py's switch."""
        ...


class LanguageModelWrapper:
    """For VLMs: token embeddings, the decoder pass and the LM head are those of
    `self.language_model` (a CausalLM with embed_input_ids). Mix in before ModelBase."""

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

    def decoder_layers(self) -> nn.ModuleList:
        return self.language_model.decoder_layers()  # type: ignore[no-any-return]

    def fuse_input_quant(self) -> None:
        self.language_model.fuse_input_quant()

    def weight_shard(self, name: str, shape: tuple[int, ...]) -> Shard | None:
        """The language model's tensors are sharded as its own; the vision tower and the
        projector are held whole by every rank."""
        if any(part in name for part in _VISION_PARTS):
            return None
        return self.language_model.weight_shard(name, shape)  # type: ignore[no-any-return]


def check_capabilities(model: CausalLM) -> None:
    """TypeError when the model declares a capability whose Protocol it does not implement
    (each flag's Protocol is named beside it in ModelCapabilities)."""
    caps = model.capabilities
    promised = (
        (caps.reads_images, MultiModalCausalLM),
        (caps.uses_mrope, MRopeModel),
        (caps.dual_encoder, DualEncoderModel),
    )
    for declared, view in promised:
        if declared and not isinstance(model, view):
            raise TypeError(f"{type(model).__name__} declares a {view.__name__} but is not one")
