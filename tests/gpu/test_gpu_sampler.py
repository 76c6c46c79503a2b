"""The sampler on CUDA logits (no topk prefix there, exponential_() for the noise, batched
penalties and logprobs without host reads per row) against the parameters' definitions, as
tests/runner/test_sampler.py checks the CPU.

Skipped without CUDA; run on the GPU machine with `python -m pytest tests/gpu`."""

from __future__ import annotations

import pytest
import torch

from mmserve.params import SamplingParams
from mmserve.runner import sampler
from tests.runner.test_sampler import definition, penalised_one_row_at_a_time, row

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]
KINDS = [
    {}, {"top_k": 50}, {"top_p": 0.9}, {"min_p": 0.05}, {"top_k": 40, "top_p": 0.8, "min_p": 0.02},
    {"temperature": 0.7, "top_p": 0.95}, {"top_p": 0.995},
]  # fmt: skip


def test_gpu_filtered_distributions_follow_the_definition() -> None:
    gen = torch.Generator().manual_seed(0)
    for spread in (6.0, 0.3):
        logits = torch.randn(len(KINDS), 5000, generator=gen) * spread
        got = sampler._filtered_probs(logits.cuda(), [row(**kw) for kw in KINDS]).cpu()
        for i, kw in enumerate(KINDS):
            want = definition(logits[i], SamplingParams(**kw))
            assert torch.equal(got[i] > 0, want > 0), kw
            torch.testing.assert_close(got[i].double(), want, atol=1e-6, rtol=1e-4)


def test_gpu_noise_draws_the_distribution() -> None:
    p = torch.tensor([0.5, 0.3, 0.15, 0.05, 0.0], device="cuda")
    n = 40_000
    tokens = sampler.draw(p.repeat(n, 1), [row() for _ in range(n)], torch.Generator("cuda").manual_seed(3))
    counts = torch.bincount(tokens.cpu(), minlength=5).double() / n
    sigma = (p.cpu() * (1 - p.cpu()) / n).sqrt()
    assert counts[4] == 0 and ((counts - p.cpu()).abs() <= 5 * sigma + 1e-12).all(), counts


def test_gpu_penalties_and_logprobs_equal_the_cpu_references() -> None:
    gen = torch.Generator().manual_seed(5)
    kinds = [{"repetition_penalty": 1.3, "logprobs": 3}, {"presence_penalty": 0.7, "frequency_penalty": 0.2},
             {"logit_bias": {3: 2.0}, "min_tokens": 9, "logprobs": 1}, {}]  # fmt: skip
    rows = [row(prompt=range(0, 60, 3), output=[1, 2, 2, 5], eos=(0,), temperature=0.0, **kw) for kw in kinds]
    logits = torch.randn(len(rows), 300, generator=gen)
    expected = logits.clone()
    for i, r in enumerate(rows):
        for t, b in r.params.logit_bias.items():
            expected[i, t] += b
        if len(r.output_token_ids) < r.params.min_tokens:
            expected[i, 0] = float("-inf")
        penalised_one_row_at_a_time(expected[i], r)
    adjusted = [i for i, r in enumerate(rows) if sampler._adjusts_logits(r)]
    assert torch.equal(sampler._adjusted(logits.cuda(), rows, adjusted).cpu(), expected)
    tokens, lp = sampler.sample(logits.cuda(), rows)
    assert tokens == expected.argmax(-1).tolist()
    raw = logits.log_softmax(-1)
    for i, k in enumerate(r.params.logprobs for r in rows):
        if k:
            got = lp[i]
            assert got is not None and got.rank == int((raw[i] > raw[i, tokens[i]]).sum()) + 1
            assert [t for t, _ in got.top] == raw[i].topk(k).indices.tolist()
        else:
            assert lp[i] is None
