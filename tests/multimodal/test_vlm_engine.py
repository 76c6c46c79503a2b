"""Vision-language models end to end through the offline API (LLM.chat with images): greedy
tokens equal transformers' generate on the same tiny random checkpoint, with chunked prefill
across images, several images of different sizes, the prefix cache keyed on image content and
the encoder cache."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import PIL.Image
import pytest
import torch

from mmserve.entrypoints.llm import LLM
from mmserve.errors import InvalidArgument
from mmserve.params import SamplingParams
from tests.utils.tiny_qwen_vl import make_tiny_qwen2_vl
from tests.utils.tiny_vlm import make_tiny_llava

MAX_TOKENS = 8


def picture(height: int, width: int, seed: int) -> PIL.Image.Image:
    rng = np.random.RandomState(seed)
    return PIL.Image.fromarray(rng.randint(0, 256, (height, width, 3), dtype=np.uint8))


def conversation(*images: PIL.Image.Image, text: str = "what is in the pictures?") -> list[dict]:
    parts: list[dict[str, Any]] = [{"type": "image", "image": im} for im in images]
    return [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]


def hf_greedy(folder: Path, conv: list[dict], images: list[PIL.Image.Image]) -> list[int]:
    """transformers' own path: processor tensors, placeholders expanded, generate."""
    from transformers import AutoImageProcessor, AutoModelForImageTextToText, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    processor = AutoImageProcessor.from_pretrained(folder)
    model = AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32).eval()
    plain = [{**m, "content": [{"type": p["type"], **({"text": p["text"]} if p["type"] == "text" else {})} for p in m["content"]]} for m in conv]
    ids = tokenizer.apply_chat_template(plain, add_generation_prompt=True, tokenize=True, return_dict=False)
    pixel = processor(images=images, return_tensors="pt")
    pad = model.config.image_token_id
    counts = iter(image_token_counts(model.config, processor, pixel))
    expanded: list[int] = []
    for t in ids:
        expanded += [pad] * next(counts) if t == pad else [t]
    input_ids = torch.tensor([expanded])
    extra = {}
    if "image_grid_thw" in pixel:  # M-RoPE needs to know which tokens are images
        extra["mm_token_type_ids"] = (input_ids == pad).int()
    out = model.generate(
        input_ids=input_ids,
        attention_mask=torch.ones_like(input_ids),
        **extra,
        **pixel,
        max_new_tokens=MAX_TOKENS, do_sample=False,
    )
    return out[0, input_ids.shape[1] :].tolist()


def image_token_counts(config: Any, processor: Any, pixel: Any) -> list[int]:
    """Placeholder tokens per image, as transformers' own processors expand them."""
    if "image_grid_thw" in pixel:  # Qwen2-VL: patches merged 2x2
        return [int(g.prod()) // processor.merge_size**2 for g in pixel["image_grid_thw"]]
    patch = config.vision_config.patch_size
    height, width = pixel["pixel_values"].shape[-2:]
    # the tower's tokens (CLIP adds a class token); "default" drops the first (even SigLIP's)
    count = (height // patch) * (width // patch) + (config.vision_config.model_type == "clip_vision_model")
    count -= config.vision_feature_select_strategy == "default"
    return [count] * len(pixel["pixel_values"])


@pytest.fixture(scope="module", params=["qwen2", "qwen2.5", "llava-clip", "llava-siglip"])
def folder(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    family, _, variant = request.param.partition("-")
    if family == "llava":
        return make_tiny_llava(tmp_path_factory.mktemp("vlm"), variant)
    return make_tiny_qwen2_vl(tmp_path_factory.mktemp("vlm"), family.removeprefix("qwen"))


GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)


@pytest.mark.parametrize("budget", [2048, 16])  # 16: prefill chunks split inside images
def test_greedy_equals_transformers(folder: Path, budget: int) -> None:
    llm = LLM(str(folder), block_size=4, max_num_batched_tokens=budget, enable_prefix_caching=False)
    one = [picture(24, 40, 0)]
    two = [picture(24, 40, 1), picture(50, 20, 2)]
    outs = llm.chat([conversation(*one), conversation(*two)], GREEDY, use_tqdm=False)
    assert outs[0].outputs[0].token_ids == hf_greedy(folder, conversation(*one), one)
    assert outs[1].outputs[0].token_ids == hf_greedy(folder, conversation(*two), two)


def test_repeated_image_hits_both_caches(folder: Path) -> None:
    llm = LLM(str(folder), block_size=4)
    runner = llm.frontend.core.runner
    calls: list[int] = []
    encode = runner.model.encode_images
    runner.model.encode_images = lambda data: calls.append(len(data)) or encode(data)  # type: ignore[method-assign]
    image = picture(24, 40, 3)
    first = llm.chat(conversation(image), GREEDY, use_tqdm=False)[0]
    again = llm.chat(conversation(image), GREEDY, use_tqdm=False)[0]
    num_prompt = len(again.prompt_token_ids)
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    assert again.num_cached_tokens == (num_prompt - 1) // 4 * 4  # every full block, image too
    # a different picture of the same size: same placeholder tokens, no hit on the image
    other = llm.chat(conversation(picture(24, 40, 4)), GREEDY, use_tqdm=False)[0]
    assert other.prompt_token_ids == again.prompt_token_ids
    assert other.num_cached_tokens < 8  # only the blocks before the image (3 template tokens)
    assert calls == [1, 1]  # the repeat needed no encoder run
    # the same image behind a longer text: the prefix cache misses, the encoder cache hits
    llm.chat(conversation(image, text="a much longer question than before"), GREEDY, use_tqdm=False)
    assert calls == [1, 1]


def test_image_errors_name_the_field(folder: Path) -> None:
    llm = LLM(str(folder), block_size=4)
    with pytest.raises(InvalidArgument, match=r"messages\[0\]\.content\[0\]\.image.*too small"):
        llm.chat(conversation(picture(1, 1, 0)), GREEDY, use_tqdm=False)
    pad = llm.frontend.images.image_token_id
    with pytest.raises(InvalidArgument, match=r"^token_ids: .*appears where no image is"):
        llm.generate([[1, pad, 2]], GREEDY, use_tqdm=False)
