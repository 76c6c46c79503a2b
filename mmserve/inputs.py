"""What a request carries besides token ids: its images, as the engine and the prefix cache
see them. Data only (no model, no scheduler), below every layer that passes it on."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class MMPlaceholder:
    """Where one image's tokens sit in the prompt."""

    content_hash: str  # hash of the image content (and of its preprocessing)
    offset: int  # index of its first placeholder token in the prompt
    length: int  # number of placeholder tokens


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
