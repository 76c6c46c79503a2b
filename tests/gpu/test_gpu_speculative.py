"""Speculative decoding on the GPU (Triton attention with several query tokens per decoding
request, guesses checked on the device) against transformers' greedy tokens, and seeded
sampling in bf16 unchanged by it.

Skipped without CUDA; run on the GPU machine with `python -m pytest tests/gpu`."""

from __future__ import annotations

import pytest
import torch

from mmserve import LLM, SamplingParams
from tests.entrypoints.test_llm_offline import hf_greedy
from tests.speculative.test_speculative_llm import PROMPTS
from tests.utils.tiny_models import make_tiny_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=48)


@pytest.mark.parametrize("method", ["ngram", "suffix"])
def test_gpu_speculative_greedy_is_transformers(tmp_path, method: str) -> None:  # type: ignore[no-untyped-def]
    path = str(make_tiny_model(tmp_path, arch="llama"))
    llm = LLM(path, device="cuda", dtype="float32", num_kv_blocks=256, speculative=method)
    out = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    for prompt, result in zip(PROMPTS, out, strict=True):
        ids = llm.tokenizer.encode(prompt)
        assert result.outputs[0].token_ids == hf_greedy(path, ids, 48, ignore_eos=False), prompt
    assert sum(r.num_accepted_draft_tokens for r in out) > 0
    pool = llm.frontend.core.kv.pool
    assert pool.num_free_blocks == pool.num_blocks


def test_gpu_bf16_greedy_and_seeded_unchanged(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """In bf16 the 1 + k token steps and the 1-token steps (CUDA graphs) may round apart:
    the outputs must still agree with speculation off, token for token (a tie flipped by
    rounding would show here: the tiny model's logits are far from ties)."""
    path = str(make_tiny_model(tmp_path, arch="llama"))
    sampled = SamplingParams(temperature=0.3, top_p=0.9, max_tokens=48, seed=3)
    base = LLM(path, device="cuda", dtype="bfloat16", num_kv_blocks=256)
    spec = LLM(path, device="cuda", dtype="bfloat16", num_kv_blocks=256, speculative="ngram")
    for params in (GREEDY, sampled):
        want = [r.outputs[0].token_ids for r in base.generate(PROMPTS, params, use_tqdm=False)]
        got = spec.generate(PROMPTS, params, use_tqdm=False)
        assert [r.outputs[0].token_ids for r in got] == want


def test_gpu_draft_model_greedy_is_transformers_and_seeded_unchanged(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A draft model on the GPU (its own KV cache, CUDA graphs for its one-token steps):
    greedy tokens are transformers' in float32; in bf16 seeded sampling is unchanged and a
    draft of the model itself is right (nearly) every time; both KV pools come back whole."""
    from tests.speculative.test_draft import assert_draft_blocks_free, layer_skip_draft

    path = str(make_tiny_model(tmp_path, arch="llama"))
    draft = str(layer_skip_draft(tmp_path))
    llm = LLM(path, device="cuda", dtype="float32", num_kv_blocks=256, speculative=f"draft={draft}")
    out = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    for prompt, result in zip(PROMPTS, out, strict=True):
        ids = llm.tokenizer.encode(prompt)
        assert result.outputs[0].token_ids == hf_greedy(path, ids, 48, ignore_eos=False), prompt
    assert sum(r.num_accepted_draft_tokens for r in out) > 0
    assert_draft_blocks_free(llm)
    sampled = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=48, seed=3)
    base = LLM(path, device="cuda", dtype="bfloat16", num_kv_blocks=256)
    spec = LLM(path, device="cuda", dtype="bfloat16", num_kv_blocks=256, speculative=f"draft={path}")
    want = [r.outputs[0].token_ids for r in base.generate(PROMPTS, sampled, use_tqdm=False)]
    got = spec.generate(PROMPTS, sampled, use_tqdm=False)
    assert [r.outputs[0].token_ids for r in got] == want
    drafts = sum(r.num_draft_tokens for r in got)
    assert drafts > 0 and sum(r.num_accepted_draft_tokens for r in got) >= 0.8 * drafts
    unseeded = spec.generate(PROMPTS, SamplingParams(temperature=1.0, max_tokens=48), use_tqdm=False)
    drafts = sum(r.num_draft_tokens for r in unseeded)
    assert drafts > 0 and sum(r.num_accepted_draft_tokens for r in unseeded) >= 0.8 * drafts
    assert_draft_blocks_free(spec)
