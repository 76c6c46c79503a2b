"""Vision-language models and dual encoders on the GPU path against transformers on the same
weights (float32: the same greedy tokens as transformers' generate; dual encoders: the same
embeddings as transformers' CLIP/SigLIP) and bfloat16 close to them. Skipped without CUDA."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import PIL.Image
import pytest
import torch

from mmserve import LLM, SamplingParams
from tests.utils.tiny_qwen_vl import make_tiny_qwen2_vl
from tests.utils.tiny_vlm import (
    make_tiny_clip,
    make_tiny_llava,
    make_tiny_siglip,
    transformers_embeddings,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def picture(height: int, width: int, seed: int) -> PIL.Image.Image:
    rng = np.random.RandomState(seed)
    return PIL.Image.fromarray(rng.randint(0, 256, (height, width, 3), dtype=np.uint8))


CONVERSATIONS = [
    [{"role": "user", "content": [{"type": "image", "image": picture(24, 40, 0)}, {"type": "text", "text": "hi"}]}],
    [{"role": "user", "content": [
        {"type": "image", "image": picture(24, 40, 1)},
        {"type": "text", "text": "and"},
        {"type": "image", "image": picture(50, 20, 2)},
    ]}],
]


def _make(kind: str, path: Path) -> Path:
    if kind.startswith("llava"):
        return make_tiny_llava(path, kind.split("-")[1])
    return make_tiny_qwen2_vl(path, kind.removeprefix("qwen"))


def _chat(folder: Path, device: str, dtype: str, **kw: object) -> list[tuple[list[int], list[int]]]:
    """(prompt token ids as the engine expanded them, greedy output) per conversation."""
    llm = LLM(str(folder), device=device, dtype=dtype, num_kv_blocks=128, block_size=16, **kw)  # type: ignore[arg-type]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    results = llm.chat(CONVERSATIONS, params, use_tqdm=False)
    return [(r.prompt_token_ids, r.outputs[0].token_ids) for r in results]


def _images(conversation: list[dict[str, Any]]) -> list[PIL.Image.Image]:
    return [p["image"] for m in conversation for p in m["content"] if p["type"] == "image"]


@torch.no_grad()
def _transformers_greedy(folder: Path, kind: str, prompts: list[list[int]]) -> list[list[int]]:
    """transformers' greedy generate (16 tokens, float32, on the GPU) from the same prompt ids
    and its own image processor's pixels."""
    from transformers import AutoImageProcessor, AutoModelForImageTextToText

    hf = AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32).cuda().eval()
    # ignore_eos: EOS may be the greedy token (min_new_tokens would forbid it instead)
    hf.generation_config.eos_token_id, hf.generation_config.pad_token_id = None, 0
    processor = AutoImageProcessor.from_pretrained(folder)
    image_token = hf.config.image_token_id if hasattr(hf.config, "image_token_id") else hf.config.image_token_index
    outputs = []
    for ids, conversation in zip(prompts, CONVERSATIONS[: len(prompts)], strict=True):
        processed = [processor(images=[im], return_tensors="pt") for im in _images(conversation)]
        input_ids = torch.tensor([ids], device="cuda")
        inputs: dict[str, torch.Tensor] = {
            "pixel_values": torch.cat([p["pixel_values"] for p in processed]).cuda()
        }
        if not kind.startswith("llava"):
            inputs["image_grid_thw"] = torch.cat([p["image_grid_thw"] for p in processed]).cuda()
            inputs["mm_token_type_ids"] = (input_ids == image_token).int()
        out = hf.generate(
            input_ids, **inputs, max_new_tokens=16, do_sample=False,
            attention_mask=torch.ones_like(input_ids),
        )
        outputs.append(out[0, len(ids):].tolist())
    return outputs


@pytest.mark.parametrize("kind", ["qwen2", "qwen2.5", "llava-clip", "llava-siglip"])
def test_gpu_vlm_greedy_equals_transformers_fp32(tmp_path: Path, kind: str) -> None:
    folder = _make(kind, tmp_path)
    ours = _chat(folder, "cuda", "float32")
    expected = _transformers_greedy(folder, kind, [ids for ids, _ in ours])
    assert [out for _, out in ours] == expected
    chunked = _chat(folder, "cuda", "float32", max_num_batched_tokens=16)  # chunked in images
    assert [out for _, out in chunked] == expected
    bf16 = _chat(folder, "cuda", "bfloat16")
    assert all(len(out) == 16 for _, out in bf16)
    # bfloat16 rounding may flip a near-tie of a random tiny model late; the first token rarely
    assert sum(out[0] == ref[0] for (_, out), ref in zip(bf16, expected)) >= 1


@pytest.mark.parametrize("kind", ["qwen2", "qwen2.5"])
def test_gpu_vision_tower_graphs_equal_eager(tmp_path: Path, kind: str) -> None:
    """The Qwen2-VL tower replayed from its CUDA graphs (one per list of image sizes, captured
    as they come) gives the eager tower's tokens, on repeats and new sizes alike (float32)."""
    from transformers import AutoImageProcessor

    folder = _make(kind, tmp_path)
    llm = LLM(str(folder), device="cuda", dtype="float32", num_kv_blocks=128, block_size=16)
    model = llm.frontend.core.runner.model
    assert model.visual_graphs is not None  # type: ignore[attr-defined]
    processor = AutoImageProcessor.from_pretrained(folder)
    batches = [[picture(24, 40, 0)], [picture(24, 40, 3)], [picture(24, 40, 4), picture(50, 20, 5)], [picture(50, 20, 6)]]
    for images in batches * 2:
        data = [dict(processor(images=[p], return_tensors="pt")) for p in images]
        graphed = model.encode_images(data)  # type: ignore[attr-defined]
        graphs, model.visual_graphs = model.visual_graphs, None  # type: ignore[attr-defined]
        eager = model.encode_images(data)  # type: ignore[attr-defined]
        model.visual_graphs = graphs  # type: ignore[attr-defined]
        for got, want in zip(graphed, eager, strict=True):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("make", [make_tiny_clip, make_tiny_siglip])
def test_gpu_dual_encoder_embeddings_match_transformers(tmp_path: Path, make: object) -> None:
    folder = make(tmp_path)  # type: ignore[operator]
    inputs = ["a cat", picture(40, 30, 3), "two dogs on a sofa"]
    expected = transformers_embeddings(folder, inputs, device="cuda")
    gpu = torch.tensor(LLM(str(folder), device="cuda", dtype="float32").embed(inputs))
    torch.testing.assert_close(gpu, expected, atol=1e-4, rtol=0)
    half = torch.tensor(LLM(str(folder), device="cuda", dtype="bfloat16").embed(inputs))
    assert torch.nn.functional.cosine_similarity(expected, half).min() > 0.99


def test_gpu_mrope_decode_graph_with_a_prompt_tail_in_the_batch(tmp_path: Path) -> None:
    """A Qwen2-VL request whose image prompt is all in the prefix cache but its last token
    (block_size 1) runs that token in a decode step beside another request's decode: the
    CUDA graph then takes [3, batch] M-RoPE positions. Both give transformers' tokens."""
    from mmserve.frontend.chat import ChatInput
    from mmserve.processors.images import local_image

    folder = _make("qwen2", tmp_path)
    llm = LLM(str(folder), device="cuda", dtype="float32", num_kv_blocks=4096, block_size=1)
    conversation = CONVERSATIONS[0]
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "hi"}]}]
    chat = ChatInput(messages, image_fields=["messages[0].content[0].image"])
    prompt = llm.frontend.render_chat(chat, [local_image(_images(conversation)[0], "image")])
    expected = _transformers_greedy(folder, "qwen2", [prompt.token_ids])[0]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    fe, outputs = llm.frontend, {"a": [], "b": []}
    fe.add_request("a", prompt.token_ids, params.clone(), mm_inputs=prompt.mm_inputs)
    for step in range(40):
        if step == 3:  # "a" decodes; "b" finds all of its prompt cached but the last token
            fe.add_request("b", prompt.token_ids, params.clone(), mm_inputs=prompt.mm_inputs)
        for delta in fe.step_deltas():
            outputs[delta.request_id] += delta.token_ids
        if step > 3 and not fe.has_unfinished:
            break
    assert outputs["a"] == expected and outputs["b"] == expected
