"""INT8 w8a8 on the GPU: the products (the rows kernel, torch._int_mm or the Triton GEMM for
many rows) against the exact reference, and the engine's greedy tokens against transformers with fake-quantised
int8 projections. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

from mmserve import LLM, SamplingParams
from tests.models.test_int8 import PROMPT, fake_quantised
from tests.utils.tiny_models import make_tiny_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


@pytest.mark.parametrize("large_gemm", ["int_mm", "triton"])
@pytest.mark.parametrize("rows", [1, 16, 17, 300])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_int_mm_is_the_reference(rows: int, dtype: torch.dtype, large_gemm: str, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from mmserve.models import int8
    from mmserve.models.int8 import Int8Linear, int8_linear_ref

    monkeypatch.setattr(int8, "LARGE_GEMM", large_gemm)
    torch.manual_seed(rows)
    linear = torch.nn.Linear(512, 264, bias=True, device="cuda", dtype=dtype)
    layer = Int8Linear.from_linear(linear)
    x = torch.randn(rows, 512, device="cuda", dtype=dtype)
    got = layer(x).float()
    want = int8_linear_ref(x, layer.weight, layer.weight_scale).to(dtype).float() + linear.bias.float()
    torch.testing.assert_close(got, want, atol=2e-2 if dtype == torch.bfloat16 else 1e-4, rtol=1e-2)


def test_gpu_int8_engine_greedy_is_the_reference(tmp_path) -> None:  # type: ignore[no-untyped-def]
    path = str(make_tiny_model(tmp_path, "llama"))
    llm = LLM(path, device="cuda", dtype="float32", num_kv_blocks=256, quantization="int8")
    ids = llm.tokenizer.encode(PROMPT)
    got = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0].token_ids  # fmt: skip
    reference = fake_quantised(path)
    with torch.no_grad():
        want = reference.generate(torch.tensor([ids]), max_new_tokens=16, min_new_tokens=16,
                                  do_sample=False, pad_token_id=0)[0, len(ids):].tolist()  # fmt: skip
    assert got == want
