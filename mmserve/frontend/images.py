"""Images in prompts: decoded images -> expanded placeholder tokens + what the encoder reads.

The chat template places one `image_token_id` per image. ImagePrompts runs the model's own
image processor (cached by content hash), counts the tokens each image takes (the engine's
EngineInfo says how: the model is not read here), and expands each placeholder into that many
copies; each image becomes an MMInput that says
where its tokens sit (an MMPlaceholder, which also keys the prefix cache by image content)
and carries the processor's tensors for the vision encoder. CPU work: the server calls
process() on a worker thread.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from mmserve.engine.messages import EngineInfo
from mmserve.errors import InvalidArgument
from mmserve.inputs import MMInput, MMPlaceholder
from mmserve.processors.image_processing import ImagePreprocessor
from mmserve.processors.images import DecodedImage


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
    """Expands the images of prompts for one model that reads or embeds images
    (thread-safe)."""

    def __init__(self, info: EngineInfo, preprocessor: ImagePreprocessor) -> None:
        self.preprocessor = preprocessor
        self.image_token_id = info.image_token_id  # -1: dual encoders (one image per input)
        self.rule = info.image_tokens  # None: dual encoders (never expanded)

    @classmethod
    def of(cls, info: EngineInfo) -> ImagePrompts | None:
        """The image front end of a model that reads or embeds images (its own image
        processor from preprocessor_config.json); None for text-only models."""
        if not (info.reads_images or info.embeds_images):
            return None
        return cls(info, ImagePreprocessor.from_pretrained(Path(info.model_folder)))

    def process(
        self, token_ids: Sequence[int], images: Sequence[DecodedImage], fields: Sequence[str]
    ) -> tuple[list[int], tuple[MMInput, ...]]:
        """(expanded token ids, one MMInput per image); InvalidArgument names the field."""
        if self.rule is None:
            raise InvalidArgument(fields[0] if fields else "prompt", "this model reads no images")
        data = [self.preprocessor.preprocess(im, f).tensors for im, f in zip(images, fields)]
        lengths = [self.rule.count(d) for d in data]
        # the rendered prompt as a whole (its images may lie in several messages)
        field = fields[0].split("[")[0] if fields else "prompt"
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
