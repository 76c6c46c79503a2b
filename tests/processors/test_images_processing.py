"""Preprocessing through transformers' own image processors, cached by content hash."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import CLIPImageProcessor, Qwen2VLImageProcessor

from mmserve.errors import InvalidArgument, UnsupportedModel
from mmserve.processors.image_processing import (
    ImagePreprocessor,
    load_image_processor,
    processor_identity,
)
from mmserve.processors.images import DecodedImage, ImageLimits, decode_image

FIELD = "chat.messages[0].content[0].image"


def decoded(width: int, height: int, seed: int = 0, fmt: str = "PNG") -> DecodedImage:
    rng = np.random.default_rng(seed)
    im = Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8), "RGB")
    buf = io.BytesIO()
    im.save(buf, fmt, **({"lossless": True} if fmt == "WEBP" else {}))
    return decode_image(buf.getvalue(), FIELD, ImageLimits())


@pytest.fixture(scope="module")
def clip_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("clip")
    CLIPImageProcessor(size={"shortest_edge": 32}, crop_size=32).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def qwen_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("qwen2vl")
    Qwen2VLImageProcessor(min_pixels=56 * 56, max_pixels=112 * 112).save_pretrained(folder)
    return folder


class CountingProcessor:
    """Forwards to a real processor and counts calls."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.calls = inner, 0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        return self.inner(*args, **kwargs)

    def to_json_string(self) -> str:
        return str(self.inner.to_json_string())


@pytest.mark.parametrize("which", ["clip", "qwen"])
def test_matches_the_hf_processor(which: str, clip_folder: Path, qwen_folder: Path) -> None:
    folder = clip_folder if which == "clip" else qwen_folder
    pre = ImagePreprocessor.from_pretrained(folder)
    for image in (decoded(40, 30), decoded(90, 57, seed=1)):
        ours = pre.preprocess(image, FIELD)
        theirs = load_image_processor(folder)(images=[image.image], return_tensors="pt")
        assert set(ours.tensors) == {k for k, v in theirs.items() if torch.is_tensor(v)}
        for key, value in ours.tensors.items():
            assert torch.equal(value, theirs[key]), key
        assert ours.content_hash == image.content_hash
        assert ours.nbytes == sum(t.numel() * t.element_size() for t in ours.tensors.values())
    if which == "qwen":
        assert ours.image_grid_thw is not None and ours.image_grid_thw.shape == (1, 3)
        t, h, w = ours.image_grid_thw[0].tolist()
        assert ours.pixel_values.shape[0] == t * h * w
    else:
        assert ours.pixel_values.shape == (1, 3, 32, 32) and ours.image_grid_thw is None


def test_cache_hit_skips_the_processor(qwen_folder: Path) -> None:
    counting = CountingProcessor(load_image_processor(qwen_folder))
    pre = ImagePreprocessor(counting, cache_bytes=1 << 20)
    first = pre.preprocess(decoded(40, 30, fmt="PNG"), FIELD)
    # The same pixels in another lossless encoding: a hit, no second call.
    second = pre.preprocess(decoded(40, 30, fmt="WEBP"), FIELD)
    assert second is first and counting.calls == 1
    pre.preprocess(decoded(40, 30, seed=5), FIELD)
    assert counting.calls == 2 and pre.cache.hits == 1


def test_cache_is_byte_bounded(qwen_folder: Path) -> None:
    counting = CountingProcessor(load_image_processor(qwen_folder))
    pre = ImagePreprocessor(counting, cache_bytes=0)
    image = decoded(40, 30)
    pre.preprocess(image, FIELD)
    pre.preprocess(image, FIELD)
    assert counting.calls == 2 and len(pre.cache) == 0


def test_processor_identity_separates_configs(clip_folder: Path, qwen_folder: Path) -> None:
    clip, qwen = load_image_processor(clip_folder), load_image_processor(qwen_folder)
    assert processor_identity(clip) == processor_identity(load_image_processor(clip_folder))
    assert processor_identity(clip) != processor_identity(qwen)
    assert processor_identity(qwen) != processor_identity(
        Qwen2VLImageProcessor(min_pixels=56 * 56, max_pixels=224 * 224)
    )
    assert processor_identity(clip) != processor_identity(clip, {"do_center_crop": False})


def test_processor_refusal_names_the_field(qwen_folder: Path) -> None:
    pre = ImagePreprocessor.from_pretrained(qwen_folder)
    with pytest.raises(InvalidArgument) as info:
        pre.preprocess(decoded(2, 500), FIELD)  # aspect ratio 250 > Qwen2-VL's 200
    assert info.value.field == FIELD and "aspect ratio" in str(info.value)


def test_folder_without_processor(tmp_path: Path) -> None:
    with pytest.raises(UnsupportedModel):
        load_image_processor(tmp_path)
