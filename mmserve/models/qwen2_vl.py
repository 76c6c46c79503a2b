"""Qwen2-VL and Qwen2.5-VL: a vision tower (qwen2_vl_vision) feeding the Qwen2 decoder of
llama.py, whose rotary embedding is swapped for multimodal rotary (M-RoPE).

M-RoPE gives every token three positions (temporal, height, width); each slice of the rotary
frequencies (mrope_section) reads one of them. Text tokens have three equal positions, an
image's tokens their grid coordinates offset by the text before them (mrope_positions).

Checkpoint names: transformers 5 writes (and v4 wrote) `visual.*`, `model.*` (the LM) and
`lm_head.weight`; transformers 5's in-memory names `model.visual.*`, `model.language_model.*`
are accepted too.
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, ClassVar

import torch

from mmserve.attention import AttentionBackend
from mmserve.errors import InvalidArgument, UnsupportedModel
from mmserve.models.base import (
    Grid,
    ImageTokenCount,
    LanguageModelWrapper,
    ModelBase,
    ModelCapabilities,
    image_grid,
)
from mmserve.models.layers import Rope, RotaryEmbedding, load_into
from mmserve.models.llama import LlamaForCausalLM
from mmserve.models.qwen2_vl_vision import VisionTransformer, vision_spec


class MRotaryEmbedding(RotaryEmbedding):
    """Rotary over positions [3, T]: frequency slice i of mrope_section reads row i % 3, as
    transformers' Qwen2-VL rotary does. 1-D positions [T] act as three equal rows."""

    def __init__(
        self, hf_config: Any, head_dim: int, mrope_section: list[int], max_positions: int = 0
    ) -> None:
        super().__init__(hf_config, head_dim, max_positions)
        if sum(mrope_section) != self.inv_freq.numel():
            raise UnsupportedModel(f"mrope_section {mrope_section} does not sum to head_dim / 2")
        self.mrope_section = list(mrope_section)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> Rope:
        if positions.ndim == 1:  # three equal rows select plain rotary (on CUDA, the kernel's)
            return super().forward(positions, dtype)
        freqs = positions.float()[..., None] * self.inv_freq  # [3, T, D/2]
        sections = freqs.split(self.mrope_section, dim=-1)
        freqs = torch.cat([part[i % 3] for i, part in enumerate(sections)], dim=-1)  # [T, D/2]
        cos = (freqs.cos() * self.scale).to(dtype)
        sin = (freqs.sin() * self.scale).to(dtype)
        return Rope(cos.unsqueeze(1), sin.unsqueeze(1), None)


def text_config_as_qwen2(hf_config: Any) -> Any:
    """The text config, read by llama.py as a Qwen2 decoder (q/k/v biases, no o_proj bias).
    head_dim is hidden / heads whatever the config says, as in transformers' Qwen2VLAttention."""
    text = copy.deepcopy(hf_config.text_config)
    text.model_type = "qwen2"
    text.head_dim = text.hidden_size // text.num_attention_heads
    text.tie_word_embeddings = bool(hf_config.tie_word_embeddings)  # v5 keeps it outside
    return text


def mrope_positions(
    token_ids: list[int], grid_thws: list[Grid], image_token_id: int, merge_size: int
) -> tuple[torch.Tensor, int]:
    """([3, len(token_ids)] int64, delta) as transformers' get_rope_index for one sequence:
    text runs count on from the previous end; an image starts all three rows at that end and
    spreads h and w over its merged grid; the next text starts max(h, w) / merge later."""
    pieces: list[torch.Tensor] = []
    start = 0
    grids = iter(grid_thws)
    for is_image, run in itertools.groupby(token_ids, key=lambda t: t == image_token_id):
        length = len(list(run))
        while is_image and length > 0:  # adjacent images share one run
            grid = next(grids, None)
            if grid is None:
                raise InvalidArgument("images", "more image placeholder tokens than images")
            piece = _image_positions(grid, merge_size, start)
            if piece.shape[1] > length:
                raise InvalidArgument("images", f"too few placeholder tokens for grid {grid}")
            pieces.append(piece)
            start += max(grid[1], grid[2]) // merge_size
            length -= piece.shape[1]
        if not is_image:
            pieces.append(torch.arange(start, start + length).expand(3, -1))
            start += length
    if next(grids, None) is not None:
        raise InvalidArgument("images", "more images than placeholder runs")
    if not pieces:
        return torch.zeros(3, 0, dtype=torch.long), 0
    positions = torch.cat(pieces, dim=1)
    return positions, int(positions.max()) + 1 - len(token_ids)


def _image_positions(grid: Grid, merge_size: int, start: int) -> torch.Tensor:
    """[3, t * h/m * w/m]: (t, row, col) of each merged token, each offset by start."""
    t, h, w = grid[0], grid[1] // merge_size, grid[2] // merge_size
    axes = torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w), indexing="ij")
    return torch.stack(axes).reshape(3, -1) + start


class Qwen2VLForConditionalGeneration(LanguageModelWrapper, ModelBase):
    """The MultiModalCausalLM, MRopeModel and Fp8Model (mmserve.models.base) for Qwen2-VL
    and Qwen2.5-VL checkpoints (images only; no video); fp8 swaps its language model's
    projections."""

    capabilities: ClassVar[ModelCapabilities] = ModelCapabilities(
        reads_images=True, uses_mrope=True, supports_fp8=True, tensor_parallel=True
    )

    def __init__(self, hf_config: Any, attention_backend: AttentionBackend) -> None:
        super().__init__()
        spec = vision_spec(hf_config)
        self.visual = VisionTransformer(spec)
        # the tower's CUDA graphs, the same call (set by the runner on CUDA: runner/cuda_graphs.py)
        self.visual_graphs: Callable[[torch.Tensor, list[tuple[int, int, int]]], torch.Tensor] | None = None
        self.language_model = LlamaForCausalLM(text_config_as_qwen2(hf_config), attention_backend)
        lm = self.language_model
        if spec.out_dim != lm.hidden_size:
            raise UnsupportedModel(f"vision output {spec.out_dim} != LM hidden {lm.hidden_size}")
        text = hf_config.text_config
        section = text.rope_parameters.get("mrope_section")
        if section is None:
            raise UnsupportedModel("text_config.rope_parameters has no mrope_section")
        max_positions = getattr(text, "max_position_embeddings", 0) or 0
        lm.model.rotary_emb = MRotaryEmbedding(text, lm.head_dim, section, max_positions)
        self.image_token_id = hf_config.image_token_id
        self.merge_size = spec.merge_size
        self.image_tokens = ImageTokenCount(merge_size=spec.merge_size)
        self.num_layers = lm.num_layers
        self.num_kv_heads = lm.num_kv_heads
        self.head_dim = lm.head_dim
        self.vocab_size = lm.vocab_size
        self.hidden_size = lm.hidden_size
        self.sliding_windows = lm.sliding_windows

    def mrope_positions(
        self, token_ids: list[int], grid_thws: list[Grid]
    ) -> tuple[torch.Tensor, int]:
        return mrope_positions(token_ids, grid_thws, self.image_token_id, self.merge_size)

    def num_image_tokens(self, data: Mapping[str, torch.Tensor]) -> int:
        return self.image_tokens.count(data)

    def encode_images(self, data: list[Mapping[str, torch.Tensor]]) -> list[torch.Tensor]:
        """All images in one tower pass (attention stays within each image), then split."""
        grids = [image_grid(d, self.merge_size) for d in data]
        param = next(self.visual.parameters())
        patches = torch.cat([d["pixel_values"] for d in data]).to(param.device, param.dtype)
        tower = self.visual_graphs or self.visual
        tokens = tower(patches, grids).to(self.language_model.lm_head.weight.dtype)
        return list(tokens.split([t * h * w // self.merge_size**2 for t, h, w in grids]))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Vision weights load here as they stream past; the LM's go on to llama.py's loader."""
        params = dict(self.visual.named_parameters())
        loaded: set[str] = set()

        def language_weights() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                vision_name = _vision_name(name)
                if vision_name is None:
                    yield _language_name(name), tensor
                elif vision_name not in params:
                    raise UnsupportedModel(f"unexpected weight {name}")
                else:
                    load_into(params[vision_name], tensor, name)
                    loaded.add(vision_name)

        self.language_model.load_weights(language_weights())
        missing = set(params) - loaded
        if missing:
            raise UnsupportedModel(f"checkpoint lacks weights: {sorted(missing)[:8]}")


def _vision_name(name: str) -> str | None:
    for prefix in ("visual.", "model.visual."):
        if name.startswith(prefix):
            return name[len(prefix) :]
    return None


def _language_name(name: str) -> str:
    """The name llama.py's LlamaForCausalLM gives the weight (`model.*`, `lm_head.*`)."""
    prefix = "model.language_model."
    return "model." + name[len(prefix) :] if name.startswith(prefix) else name
