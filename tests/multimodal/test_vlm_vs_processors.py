"""Image prompts against transformers' own processors and forward: the expanded prompt equals
LlavaProcessor's / Qwen2VLProcessor's / Qwen2_5_VLProcessor's input_ids for tiny, thin, odd and
over-max_pixels images, several images over several messages, at the start and the end; the
last position's and every prompt position's top logprobs equal the model's forward on the
processor's tensors (float32), with prefill chunks of 5 tokens cutting through every image."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import PIL.Image
import pytest
import torch
import transformers

from mmserve.entrypoints.llm import LLM
from mmserve.params import SamplingParams
from tests.utils.tiny_qwen_vl import make_tiny_qwen2_vl
from tests.utils.tiny_vlm import IMAGE_TOKEN, PATCH_SIZE, make_tiny_llava

# (height, width): tiny, not multiples of the 8-pixel grid, aspect ratios up to 67, past max_pixels
SIZES = [(8, 8), (9, 13), (3, 200), (200, 3), (47, 31), (17, 129), (500, 499), (7, 7), (24, 40)]
PARAMS = SamplingParams(max_tokens=1, temperature=0.0, logprobs=20, prompt_logprobs=20)


def picture(size: tuple[int, int], seed: int) -> PIL.Image.Image:
    rng = np.random.RandomState(seed)
    return PIL.Image.fromarray(rng.randint(0, 256, (*size, 3), dtype=np.uint8))


def conversations(a: Any, b: Any, c: Any) -> list[list[dict[str, Any]]]:
    """One image first in the prompt; three over two user messages, the last one's text after."""
    def part(x: Any) -> dict[str, Any]:
        return {"type": "text", "text": x} if isinstance(x, str) else {"type": "image", "image": x}

    def msg(role: str, *parts: Any) -> dict[str, Any]:
        return {"role": role, "content": [part(p) for p in parts]}

    return [
        [msg("user", a, "a")],
        [msg("user", "x", a), msg("assistant", "ok"), msg("user", b, c, "then what")],
    ]


def hf_processor(folder: Path, family: str) -> Any:
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    images = transformers.AutoImageProcessor.from_pretrained(folder)
    if family.startswith("llava"):
        config = transformers.AutoConfig.from_pretrained(folder)
        return transformers.LlavaProcessor(
            image_processor=images, tokenizer=tokenizer, patch_size=PATCH_SIZE,
            vision_feature_select_strategy=config.vision_feature_select_strategy,
            image_token=IMAGE_TOKEN, num_additional_image_tokens=int(family == "llava-clip"),
            chat_template=tokenizer.chat_template,
        )
    cls = transformers.Qwen2VLProcessor if family == "qwen2" else transformers.Qwen2_5_VLProcessor
    return cls(image_processor=images, tokenizer=tokenizer, chat_template=tokenizer.chat_template)


@pytest.mark.parametrize("family", ["qwen2", "qwen2.5", "llava-clip", "llava-siglip"])
def test_prompts_and_logprobs_equal_transformers(
    family: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # no torchvision here, so no video processor: the processors' class check would fail on it
    monkeypatch.setattr(transformers.ProcessorMixin, "check_argument_for_proper_class", lambda *a: None)
    if family.startswith("llava"):
        folder = make_tiny_llava(tmp_path, family.split("-")[1])
    else:
        folder = make_tiny_qwen2_vl(tmp_path, family.removeprefix("qwen"))
    processor = hf_processor(folder, family)
    model = transformers.AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32)
    llm = LLM(str(folder), block_size=4, max_num_batched_tokens=5, enable_prefix_caching=False)
    for i in range(0, len(SIZES), 3):
        images = [picture(SIZES[i + k], i + k) for k in range(3)]
        for conv in conversations(*images):
            out = llm.chat([conv], PARAMS, use_tqdm=False)[0]
            plain = [
                {**m, "content": [{k: v for k, v in p.items() if k != "image"} for p in m["content"]]}
                for m in conv
            ]
            text = processor.apply_chat_template(plain, add_generation_prompt=True, tokenize=False)
            shown = [p["image"] for m in conv for p in m["content"] if p["type"] == "image"]
            inputs = processor(text=[text], images=shown, return_tensors="pt")
            assert list(out.prompt_token_ids) == inputs["input_ids"][0].tolist(), [im.size for im in shown]
            with torch.no_grad():
                expected = model.eval()(**inputs).logits[0].log_softmax(-1)
            rows = [(len(out.prompt_token_ids) - 1, out.outputs[0].logprobs[0])]
            rows += [(j - 1, lp) for j, lp in enumerate(out.prompt_logprobs or []) if lp is not None]
            for position, logprob in rows:
                ids = [t for t, _ in logprob.top]
                got = torch.tensor([v for _, v in logprob.top])
                torch.testing.assert_close(got, expected[position, ids], atol=2e-5, rtol=0)
                assert ids[0] == int(expected[position].argmax())
    llm.shutdown()


def encoded(image: PIL.Image.Image, fmt: str) -> bytes:
    import io

    buf = io.BytesIO()
    image.save(buf, fmt)
    return buf.getvalue()


@pytest.mark.parametrize("family", ["qwen2", "llava-clip"])
def test_prefix_cache_keys_on_pixels_order_and_salt(family: str, tmp_path: Path) -> None:
    """Each answer equals a cache-free engine's; hits only where the pixels, their order and
    the salt are the same (PNG and BMP of one picture are the same pixels; JPEG is not)."""
    if family.startswith("llava"):
        folder = make_tiny_llava(tmp_path, family.split("-")[1])
    else:
        folder = make_tiny_qwen2_vl(tmp_path, family.removeprefix("qwen"))
    plain = LLM(str(folder), block_size=4, enable_prefix_caching=False)
    llm = LLM(str(folder), block_size=4, max_num_batched_tokens=7)
    a, b = picture((24, 40), 1), picture((24, 40), 2)
    params = SamplingParams(max_tokens=1, temperature=0.0, logprobs=20)

    def cached(*images: Any, salt: str | None = None) -> int:
        conv = [{"role": "user", "content": [*({"type": "image", "image": im} for im in images), {"type": "text", "text": "q"}]}]
        out = llm.chat([conv], params, use_tqdm=False, cache_salt=salt)[0]
        ref = plain.chat([conv], params, use_tqdm=False)[0]
        got, want = dict(out.outputs[0].logprobs[0].top), dict(ref.outputs[0].logprobs[0].top)
        assert got.keys() == want.keys() and got == pytest.approx(want, abs=2e-5)
        return out.num_cached_tokens

    template = 4  # the one full block before the first image
    assert cached(a) == 0
    full = cached(encoded(a, "PNG"))
    assert full > template + 16 and cached(encoded(a, "BMP")) == full
    assert cached(encoded(a, "JPEG")) == template
    assert cached(b) == template  # same size, same placeholder tokens, other pixels
    assert cached(a, b) == template + 16  # a's blocks only
    assert cached(b, a) == template + 16  # b's blocks from cached(b); never a's after it
    assert cached(a, salt="x") == 0 and cached(a, salt="x") == full and cached(a, salt="y") == 0
