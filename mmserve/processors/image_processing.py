"""Preprocessing through the model's own transformers image processor, cached by content.

The processor comes from the model folder's preprocessor_config.json (local files only,
never remote code), so resizing, normalisation and patching are exactly transformers'.
Results are cached under (processor identity, image content hash) in a byte-bounded LRU:
the same image sent again, in any lossless encoding, is not preprocessed again. Like
decoding, `ImagePreprocessor.preprocess` is sync CPU work the server runs via
asyncio.to_thread; the cache is thread-safe.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import AutoImageProcessor

from mmserve.errors import InvalidArgument, UnsupportedModel
from mmserve.processors.image_cache import ByteLRU
from mmserve.processors.images import DecodedImage

# Default bound on cached preprocessing results (float32 pixel tensors).
DEFAULT_CACHE_BYTES = 512 << 20

# Most pixels a processor may scale one image to before it crops. A shortest-edge resize
# (CLIP, LLaVA-1.5: 336 px) stretches a thin strip along its long side: a 2x4000 PNG of a few
# hundred bytes, well inside the decoded pixel limit, becomes 336x672000 (2 GB, seconds of
# CPU) before the centre crop keeps 336x336. Equal to images.MAX_PIXELS (aspect ratio ~220
# at 336 px); fixed-size (SigLIP) and max_pixels-bounded (Qwen2-VL) resizes never reach it.
MAX_RESIZED_PIXELS = 25_000_000


def load_image_processor(folder: str | Path) -> Any:
    """The model's image processor from `folder` (preprocessor_config.json); no hub, no
    remote code. UnsupportedModel if the folder has none."""
    try:
        return AutoImageProcessor.from_pretrained(
            str(folder), trust_remote_code=False, local_files_only=True
        )
    except (OSError, ValueError) as e:
        raise UnsupportedModel(f"{folder}: cannot load an image processor: {e}") from e


def resized_size(
    processor: Any, kwargs: Mapping[str, Any], width: int, height: int
) -> tuple[int, int] | None:
    """(width, height) of the processor's resize when it is shortest-edge only (transformers'
    get_resize_output_image_size: the short side becomes shortest_edge, the long side is
    scaled and truncated); None when it resizes otherwise (a fixed size, a longest_edge,
    Qwen2-VL's pixel bounds) or not at all. Call kwargs override the processor's settings."""
    size = kwargs.get("size", getattr(processor, "size", None))
    if not kwargs.get("do_resize", getattr(processor, "do_resize", False)) or size is None:
        return None
    shortest, longest = size.get("shortest_edge"), size.get("longest_edge")
    if shortest is None or longest is not None:
        return None
    if width <= height:
        return shortest, int(shortest * height / width)
    return int(shortest * width / height), shortest


def processor_identity(processor: Any, kwargs: Mapping[str, Any] | None = None) -> str:
    """sha256 of the processor's class, its serialised config and call kwargs: two
    processors that would preprocess differently never share cache entries."""
    digest = hashlib.sha256(type(processor).__qualname__.encode())
    digest.update(processor.to_json_string().encode())
    digest.update(repr(sorted((kwargs or {}).items())).encode())
    return digest.hexdigest()


@dataclass(frozen=True)
class PreprocessedImage:
    """The processor's output for one image; tensors are shared with the cache: read-only."""

    # pixel_values: [1, 3, H, W] for CLIP/SigLIP/LLaVA; [num_patches, C*T*P*P] flattened
    # patches for Qwen2-VL; image_grid_thw: [1, 3] (t, h, w) in patches, Qwen2-VL only.
    tensors: Mapping[str, torch.Tensor]
    content_hash: str  # DecodedImage.content_hash of the input
    nbytes: int = field(default=0)  # total tensor bytes, for the cache bound

    @property
    def pixel_values(self) -> torch.Tensor:
        return self.tensors["pixel_values"]

    @property
    def image_grid_thw(self) -> torch.Tensor | None:
        return self.tensors.get("image_grid_thw")


class ImagePreprocessor:
    """Runs one model's image processor on decoded images, with a content-hash cache."""

    def __init__(
        self,
        processor: Any,
        cache_bytes: int = DEFAULT_CACHE_BYTES,
        processor_kwargs: Mapping[str, Any] | None = None,
    ) -> None:
        self.processor = processor
        self.processor_kwargs = dict(processor_kwargs or {})
        self.identity = processor_identity(processor, self.processor_kwargs)
        self._cache: ByteLRU[tuple[str, str], PreprocessedImage] = ByteLRU(
            cache_bytes, lambda item: item.nbytes
        )

    @classmethod
    def from_pretrained(
        cls, folder: str | Path, cache_bytes: int = DEFAULT_CACHE_BYTES
    ) -> ImagePreprocessor:
        return cls(load_image_processor(folder), cache_bytes)

    @property
    def cache(self) -> ByteLRU[tuple[str, str], PreprocessedImage]:
        return self._cache

    def preprocess(self, image: DecodedImage, field: str) -> PreprocessedImage:
        """Cached processor output for `image`; InvalidArgument (naming `field`) when the
        processor refuses it, e.g. an aspect ratio Qwen2-VL cannot tile."""
        key = (self.identity, image.content_hash)
        cached = self._cache.get(key)
        if cached is not None:
            return cached
        result = self._run(image, field)
        self._cache.put(key, result)
        return result

    def _run(self, image: DecodedImage, field: str) -> PreprocessedImage:
        self._check_resize(image, field)
        try:
            out = self.processor(images=[image.image], return_tensors="pt", **self.processor_kwargs)
        except ValueError as e:
            raise InvalidArgument(field, f"the model's image processor refused it: {e}") from e
        tensors = {k: v for k, v in out.items() if isinstance(v, torch.Tensor)}
        if "pixel_values" not in tensors:
            raise UnsupportedModel(f"{type(self.processor).__name__} returned no pixel_values")
        nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
        return PreprocessedImage(tensors=tensors, content_hash=image.content_hash, nbytes=nbytes)

    def _check_resize(self, image: DecodedImage, field: str) -> None:
        """Refuses an image the processor would scale past MAX_RESIZED_PIXELS, before any of
        them is allocated."""
        width, height = image.size
        resized = resized_size(self.processor, self.processor_kwargs, width, height)
        if resized is None or resized[0] * resized[1] <= MAX_RESIZED_PIXELS:
            return
        raise InvalidArgument(
            field,
            f"{width}x{height} is too thin for this model: its image processor would resize "
            f"it to {resized[0]}x{resized[1]}, {resized[0] * resized[1]} pixels; "
            f"at most {MAX_RESIZED_PIXELS}",
        )
