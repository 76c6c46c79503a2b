"""Quantised checkpoints decoding on CUDA follow the CPU: a tiny Llama written in a format
(mmserve.bench.checkpoints, as `mmserve bench --checkpoint-format` writes the 8B shape) decodes
greedily on CUDA in bfloat16, alone (one row a step) and two at once (two rows: both take the
products with int8 activations, gguf_gemm.DP4A for Q4_K and wna16.DP4A for w4a16, up to their
DP4A_MAX_ROWS), against the CPU's float32 path on the same file (its weights dequantised, no
rounding of the activations). Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

from mmserve import LLM, SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


@pytest.mark.parametrize(
    ("fmt", "scheme", "switch"),
    [("gguf:Q4_K_M", "gguf:Q4_K+Q6_K", "gguf_gemm.DP4A"), ("w4a16-g128", "w4a16-g128", "wna16.DP4A")],
    ids=["q4_k_m", "w4a16"],
)
def test_gpu_quantized_decodes_as_the_cpu(tmp_path, fmt: str, scheme: str, switch: str) -> None:  # type: ignore[no-untyped-def]
    """Under the CPU's logits for the same prefix, each token the GPU picked is among the CPU's
    best three and within 0.1 of its best logprob, and half at least are its best. (The random
    model's next-token distribution is nearly flat: a token picked at random would lie near
    log(1 / vocabulary), about 1 below the best, and rarely in its best three.)"""
    import importlib

    from tests.utils.tiny_models import tiny_checkpoint

    module, name = switch.split(".")
    assert getattr(importlib.import_module(f"mmserve.kernels.{module}"), name)  # (the int8-activation product is the default)
    path = tiny_checkpoint(tmp_path, fmt)
    gpu = LLM(str(path), device="cuda", dtype="bfloat16", num_kv_blocks=64)
    assert gpu.frontend.info.quantization == scheme
    prompts = [gpu.tokenizer.encode(t) for t in ("The quick brown fox jumps over the lazy dog", "Pack my box")]
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    runs = [(prompts[0], gpu.generate(prompts[:1], greedy, use_tqdm=False)[0].outputs[0].token_ids)]
    runs += [(p, o.outputs[0].token_ids) for p, o in zip(prompts, gpu.generate(prompts, greedy, use_tqdm=False))]
    del gpu
    torch.cuda.empty_cache()
    cpu = LLM(str(path), device="cpu", dtype="float32", num_kv_blocks=64)
    scored = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=3)
    for prompt, tokens in runs:
        ranked = cpu.generate([prompt + list(tokens)], scored, use_tqdm=False)[0].prompt_logprobs
        assert ranked is not None
        picks = ranked[len(prompt) :]
        for pick in picks:
            assert pick is not None and pick.rank <= 3 and pick.logprob >= pick.top[0][1] - 0.1, pick
        ranks = [p.rank for p in picks if p is not None]
        # a random model's best few lie within hundredths of a nat: bf16 and the int8 rounding
        # may swap them, but a broken product would rarely pick the best at all (1 in ~400)
        assert sum(r == 1 for r in ranks) >= 8, ranks
