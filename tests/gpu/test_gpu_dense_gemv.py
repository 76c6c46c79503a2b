"""One-row decode steps on CUDA in bfloat16 take their projections' and head's products from our
own kernel (mmserve.kernels.dense_gemv, through models/layers.FewRowsLinear) and still follow
transformers on the same weights. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

from mmserve import LLM, SamplingParams
from mmserve.kernels import dense_gemv as gemv_module
from mmserve.models.layers import FewRowsLinear
from tests.utils.tiny_models import make_tiny_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # qwen2: q, k and v with biases
def test_gpu_one_row_decode_follows_transformers(tmp_path, monkeypatch, arch: str) -> None:  # type: ignore[no-untyped-def]
    """Under transformers' float32 logits for the same prefix, each token the engine picked alone
    (one row a step) is within 0.1 of the best logprob, and most are the best."""
    from transformers import AutoModelForCausalLM

    calls = []
    real = gemv_module.dense_gemv
    monkeypatch.setattr(gemv_module, "dense_gemv", lambda *a, **k: calls.append(1) or real(*a, **k))
    path = make_tiny_model(tmp_path, arch=arch)
    llm = LLM(str(path), device="cuda", dtype="bfloat16", num_kv_blocks=64)
    model = llm.frontend.core.runner.model
    swapped = [m for m in model.modules() if isinstance(m, FewRowsLinear)]
    assert len(swapped) == 4 * model.num_layers + 1  # qkv, o, gate_up, down a layer, and the head
    prompt = llm.tokenizer.encode("The quick brown fox jumps over the lazy dog")
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    tokens = list(llm.generate([prompt], greedy, use_tqdm=False)[0].outputs[0].token_ids)
    assert calls  # (at least at the one-row graph's capture)
    llm.shutdown()
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).cuda().eval()
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + tokens], device="cuda")).logits[0].float()
    logprobs = logits[len(prompt) - 1 : -1].log_softmax(-1)
    picked = logprobs.gather(1, torch.tensor(tokens, device="cuda")[:, None])[:, 0]
    best = logprobs.max(-1).values
    assert (picked >= best - 0.1).all(), (picked - best).tolist()
    assert int((picked == best).sum()) >= 10, (picked - best).tolist()
