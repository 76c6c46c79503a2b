"""Preprocessing bounds: what a model's own image processor may allocate for one image."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image
from transformers.image_transforms import get_resize_output_image_size
from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
from transformers.models.siglip.image_processing_pil_siglip import SiglipImageProcessorPil

from mmserve.errors import InvalidArgument
from mmserve.processors.image_processing import (
    MAX_RESIZED_PIXELS,
    ImagePreprocessor,
    resized_size,
)
from mmserve.processors.images import DecodedImage, ImageLimits, decode_image

FIELD = "chat.messages[0].content[1].image"
LLAVA_CLIP = CLIPImageProcessorPil(  # llava-1.5's processor
    size={"shortest_edge": 336}, crop_size={"height": 336, "width": 336}
)


def decoded(width: int, height: int) -> DecodedImage:
    rng = np.random.default_rng(0)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)).save(buf, "PNG")
    return decode_image(buf.getvalue(), FIELD, ImageLimits())


@pytest.mark.parametrize("size", [(2, 477), (3000, 7), (336, 336), (41, 1999), (500, 333)])
def test_resized_size_is_transformers(size: tuple[int, int]) -> None:
    width, height = size
    pixels = np.zeros((height, width, 3), dtype=np.uint8)
    new_height, new_width = get_resize_output_image_size(pixels, 336, default_to_square=False)
    assert resized_size(LLAVA_CLIP, {}, width, height) == (new_width, new_height)


def test_thin_strip_is_refused_before_the_processor_scales_it() -> None:
    # 954 pixels decode to 1 KiB, but a shortest-edge resize to 336 makes 336x80136 (27 MP)
    with pytest.raises(InvalidArgument) as info:
        ImagePreprocessor(LLAVA_CLIP).preprocess(decoded(2, 477), FIELD)
    assert info.value.field == FIELD
    assert "resize it to 336x80136" in str(info.value)
    assert f"at most {MAX_RESIZED_PIXELS}" in str(info.value)


def test_bounded_resizes_are_not_refused() -> None:
    # a banner is fine; fixed-size and pixel-bounded processors never scale up a strip
    image = decoded(2000, 40)
    banner = ImagePreprocessor(LLAVA_CLIP).preprocess(image, FIELD).pixel_values
    assert banner.shape == (1, 3, 336, 336)
    assert banner.equal(LLAVA_CLIP(images=[image.image], return_tensors="pt")["pixel_values"])
    strip = decoded(2, 477)
    assert resized_size(SiglipImageProcessorPil(), {}, 2, 477) is None
    assert resized_size(Qwen2VLImageProcessorPil(), {}, 2, 477) is None
    siglip = ImagePreprocessor(SiglipImageProcessorPil()).preprocess(strip, FIELD)
    assert siglip.pixel_values.shape == (1, 3, 224, 224)
