"""Vision-language models and dual encoders on the GPU path against the CPU reference path
(float32: the same greedy tokens; bfloat16: close first logprobs). Skipped without CUDA."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import PIL.Image
import pytest
import torch

from mmserve import LLM, SamplingParams
from tests.utils.tiny_qwen_vl import make_tiny_qwen2_vl
from tests.utils.tiny_vlm import make_tiny_clip, make_tiny_llava, make_tiny_siglip

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


def _chat(folder: Path, device: str, dtype: str, **kw: object) -> list[list[int]]:
    llm = LLM(str(folder), device=device, dtype=dtype, num_kv_blocks=128, block_size=16, **kw)  # type: ignore[arg-type]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.chat(CONVERSATIONS, params, use_tqdm=False)]


@pytest.mark.parametrize("kind", ["qwen2", "qwen2.5", "llava-clip", "llava-siglip"])
def test_gpu_vlm_greedy_equals_cpu_fp32(tmp_path: Path, kind: str) -> None:
    folder = _make(kind, tmp_path)
    cpu = _chat(folder, "cpu", "float32")
    assert _chat(folder, "cuda", "float32") == cpu
    assert _chat(folder, "cuda", "float32", max_num_batched_tokens=16) == cpu  # chunked in images
    bf16 = _chat(folder, "cuda", "bfloat16")
    assert all(len(t) == 16 for t in bf16)


@pytest.mark.parametrize("make", [make_tiny_clip, make_tiny_siglip])
def test_gpu_dual_encoder_embeddings_close(tmp_path: Path, make: object) -> None:
    folder = make(tmp_path)  # type: ignore[operator]
    inputs = ["a cat", picture(40, 30, 3), "two dogs on a sofa"]
    cpu = torch.tensor(LLM(str(folder), device="cpu", dtype="float32").embed(inputs))
    gpu = torch.tensor(LLM(str(folder), device="cuda", dtype="float32").embed(inputs))
    assert torch.allclose(cpu, gpu, atol=1e-4)
    half = torch.tensor(LLM(str(folder), device="cuda", dtype="bfloat16").embed(inputs))
    assert torch.nn.functional.cosine_similarity(cpu, half).min() > 0.99
