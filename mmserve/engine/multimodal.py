"""Images in prompts: decoded images -> expanded placeholder tokens + what the encoder reads.

The chat template places one `image_token_id` per image. ImagePrompts runs the model's own
image processor (cached by content hash), asks the model how many tokens each image takes,
and expands each placeholder into that many copies; each image becomes an MMInput that says
where its tokens sit (an MMPlaceholder, which also keys the prefix cache by image content)
and carries the processor's tensors for the vision encoder. CPU work: the server calls
process() on a worker thread.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from mmserve.engine.block_hash import MMPlaceholder
from mmserve.errors import InvalidArgument

if TYPE_CHECKING:  # light at import: request.py uses MMInput
    from mmserve.processors.image_processing import ImagePreprocessor
    from mmserve.processors.images import DecodedImage


@dataclass(frozen=True)
class MMInput:
    """One image of a request."""

    placeholder: MMPlaceholder  # its tokens in the prompt; content_hash keys the caches
    data: Mapping[str, torch.Tensor]  # the image processor's output for it (CPU, read-only)

    @property
    def key(self) -> str:
        """Encoder-cache key: equal content gives equal encoder output."""
        return self.placeholder.content_hash

    @property
    def start(self) -> int:
        return self.placeholder.offset

    @property
    def end(self) -> int:
        return self.placeholder.offset + self.placeholder.length

    def overlaps(self, start: int, end: int) -> bool:
        """Whether any of its tokens lies in prompt positions [start, end)."""
        return self.start < end and start < self.end


def grid_thw(data: Mapping[str, torch.Tensor]) -> tuple[int, int, int]:
    """(t, h, w) in patches of one image, from its processor output (Qwen2-VL's)."""
    t, h, w = (int(x) for x in data["image_grid_thw"].reshape(-1)[:3])
    return t, h, w


def expand_placeholders(
    token_ids: Sequence[int], image_token_id: int, lengths: Sequence[int], field: str
) -> tuple[list[int], list[tuple[int, int]]]:
    """Each single image_token_id -> lengths[i] copies; returns (ids, [(offset, length)]).
    The prompt must hold exactly one placeholder per image, not already expanded."""
    found = [i for i, t in enumerate(token_ids) if t == image_token_id]
    if len(found) != len(lengths):
        raise InvalidArgument(
            field,
            f"{len(lengths)} images but the prompt has {len(found)} image placeholders "
            "(the chat template places one per image part; prompts must not contain them)",
        )
    out: list[int] = []
    spans: list[tuple[int, int]] = []
    prev = 0
    for pos, length in zip(found, lengths):
        out += token_ids[prev:pos]
        spans.append((len(out), length))
        out += [image_token_id] * length
        prev = pos + 1
    out += token_ids[prev:]
    return out, spans


def check_placeholders(
    token_ids: Sequence[int], image_token_id: int, mm_inputs: Sequence[MMInput], field: str
) -> None:
    """Every image token is covered by exactly the spans of mm_inputs (in order), and each
    span holds only image tokens: a text-only prompt cannot smuggle placeholder tokens."""
    expected: list[int] = []
    end = -1
    for mm in mm_inputs:
        if mm.start < end or mm.end > len(token_ids) or mm.placeholder.length <= 0:
            raise InvalidArgument(field, "image spans overlap or leave the prompt")
        expected += range(mm.start, mm.end)
        end = mm.end
    found = [i for i, t in enumerate(token_ids) if t == image_token_id]
    if found != expected:
        raise InvalidArgument(
            field, f"image placeholder token {image_token_id} appears where no image is"
        )


class ImagePrompts:
    """Expands the images of prompts for one multimodal model (thread-safe)."""

    def __init__(self, model: Any, preprocessor: ImagePreprocessor) -> None:
        self.model = model  # a MultiModalCausalLM (mmserve.models.base)
        self.preprocessor = preprocessor
        self.image_token_id: int = getattr(model, "image_token_id", -1)  # -1: dual encoders

    def process(
        self, token_ids: Sequence[int], images: Sequence[DecodedImage], fields: Sequence[str]
    ) -> tuple[list[int], tuple[MMInput, ...]]:
        """(expanded token ids, one MMInput per image); InvalidArgument names the field."""
        data = [self.preprocessor.preprocess(im, f).tensors for im, f in zip(images, fields)]
        lengths = [self.model.num_image_tokens(d) for d in data]
        field = fields[0].split(".content")[0] if fields else "prompt"
        ids, spans = expand_placeholders(token_ids, self.image_token_id, lengths, field)
        inputs = tuple(
            MMInput(MMPlaceholder(im.content_hash, offset, length), d)
            for im, d, (offset, length) in zip(images, data, spans)
        )
        return ids, inputs

    def single(self, image: DecodedImage, field: str) -> MMInput:
        """One image as the whole input (image embeddings): one placeholder token at 0."""
        data = self.preprocessor.preprocess(image, field).tensors
        return MMInput(MMPlaceholder(image.content_hash, 0, 1), data)
