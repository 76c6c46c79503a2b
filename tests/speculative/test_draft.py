"""The draft-model proposer (`--speculative draft=PATH`): a small model with the model's
tokenizer guesses in the same engine, with its own KV cache. Greedy and seeded outputs are
those without speculation (and transformers' greedy tokens); unseeded sampling keeps its
distribution under rejection sampling against the draft's q (chi-square, a poor draft);
the draft catches up on long prompts in chunks, gives way in a small KV pool, and a draft
with another tokenizer is refused."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from mmserve import LLM, SamplingParams
from mmserve.speculative import ChainedProposer
from mmserve.speculative.draft import DraftProposer, FreeBlocks
from tests.entrypoints.test_llm_offline import hf_greedy
from tests.speculative.test_speculative_llm import (
    GREEDY,
    PROMPTS,
    SMALL_KV,
    accepted,
    assert_all_blocks_free,
    assert_same_distribution,
    generate,
    llm,
    tokens,
)
from tests.utils.tiny_models import make_tiny_hf_model, make_tiny_model, make_tiny_tokenizer


def layer_skip_draft(folder: Path, seed: int = 0, scale: float = 1.0) -> Path:
    """The tiny Llama of make_tiny_model(seed) with its last layer dropped (a LayerSkip-
    style draft: right often, not always)."""
    out = folder / f"draft-{seed}"
    model = make_tiny_hf_model("llama", seed)
    with torch.no_grad():
        model.lm_head.weight.mul_(scale)
    del model.model.layers[-1]
    model.config.num_hidden_layers -= 1
    model.save_pretrained(out)
    make_tiny_tokenizer().save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    """(target, draft): a tiny random Llama, and itself without its last layer."""
    folder = tmp_path_factory.mktemp("draft")
    return str(make_tiny_model(folder, "llama")), str(layer_skip_draft(folder))


def draft_of(model: LLM) -> DraftProposer:
    speculator = model.frontend.core.speculator
    assert speculator is not None
    proposer = speculator.proposer
    if isinstance(proposer, ChainedProposer):  # jump+draft=PATH
        proposer = proposer.proposers[-1]
    assert isinstance(proposer, DraftProposer)
    return proposer


def assert_draft_blocks_free(model: LLM) -> None:
    """Every request ended: the draft's KV pool is whole again too."""
    pool = draft_of(model).pool
    assert pool.num_free_blocks == pool.num_blocks


def test_greedy_is_transformers_and_a_draft_of_itself_is_always_right(
    models: tuple[str, str],
) -> None:
    target, _ = models
    spec = llm(target, speculative=f"draft={target}")
    params = GREEDY.clone(ignore_eos=False)
    out = generate(spec, PROMPTS, params)
    for prompt, result in zip(PROMPTS, out, strict=True):
        ids = spec.tokenizer.encode(prompt)
        assert result.outputs[0].token_ids == hf_greedy(target, ids, 48, ignore_eos=False), prompt
    drafts = sum(r.num_draft_tokens for r in out)
    assert drafts > 0 and accepted(out) >= 0.9 * drafts  # (the same weights: near-ties aside)
    assert spec.frontend.info.speculative == f"draft={Path(target).name}"  # (a name, no path)
    assert_all_blocks_free(spec)
    assert_draft_blocks_free(spec)


@pytest.mark.parametrize(
    "settings",
    [
        {},
        # chunked prefill; and the draft catches up on the 49-token prompt in chunks of 16
        {"max_num_batched_tokens": 16, "max_num_seqs": 2, "num_speculative_tokens": 2},
        {"num_kv_blocks": 36, "block_size": 4},  # preemption by recompute
        {"block_size": 4, "num_speculative_tokens": 7},  # prefix hits (the prompts twice)
    ],
    ids=["plain", "chunked", "preempt", "prefix"],
)
def test_greedy_is_unchanged_with_a_poor_draft(models: tuple[str, str], settings: dict[str, object]) -> None:
    target, draft = models
    base_settings = {k: v for k, v in settings.items() if k != "num_speculative_tokens"}
    prompts = PROMPTS[:3] + PROMPTS[:1]
    base = generate(llm(target, **base_settings), prompts)
    spec_llm = llm(target, speculative=f"draft={draft}", **settings)
    spec = generate(spec_llm, prompts)
    assert tokens(spec) == tokens(base)
    assert 0 < accepted(spec) < sum(r.num_draft_tokens for r in spec)
    assert_all_blocks_free(spec_llm)
    assert_draft_blocks_free(spec_llm)


def test_stop_strings_n_logprobs_and_structured_output_with_a_draft(models: tuple[str, str]) -> None:
    import json

    from mmserve.structured_output.params import StructuredOutputParams
    from tests.speculative.test_speculative_llm import SCHEMA

    target, draft = models
    base_llm, spec_llm = llm(target), llm(target, speculative=f"jump+draft={draft}")
    full = generate(base_llm, [PROMPTS[0]])[0].outputs[0]
    cut = full.text[len(full.text) // 2 :][:6]
    structured = StructuredOutputParams("json_schema", json.dumps(SCHEMA))
    for params in [
        GREEDY.clone(stop=[cut]),
        GREEDY.clone(max_tokens=5),
        GREEDY.clone(logprobs=2),
        SamplingParams(temperature=1.0, top_p=0.95, n=3, seed=3, max_tokens=24, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=96, structured=structured),
    ]:
        base, spec = generate(base_llm, PROMPTS, params), generate(spec_llm, PROMPTS, params)
        assert tokens(spec) == tokens(base), params
        for b, s in zip(base, spec, strict=True):
            assert [o.text for o in s.outputs] == [o.text for o in b.outputs]
            if params.logprobs:
                for bl, sl in zip(b.outputs[0].logprobs or [], s.outputs[0].logprobs or [], strict=True):
                    assert sl.token_id == bl.token_id
                    assert sl.logprob == pytest.approx(bl.logprob, abs=1e-4)
    assert_all_blocks_free(spec_llm)
    assert_draft_blocks_free(spec_llm)


def test_seeded_sampling_is_unchanged_and_the_draft_shares_its_noise(models: tuple[str, str]) -> None:
    """A seeded request's guesses are the draft's draws under the model's own noise for
    each position: the output is that without speculation, and a draft of the model itself
    is right every time, at temperature 1 too."""
    target, draft = models
    params = [
        SamplingParams(temperature=1.0, top_p=0.9, max_tokens=24, seed=s, ignore_eos=True)
        for s in range(4)
    ]
    prompts = [PROMPTS[0]] * len(params)
    base = generate(llm(target), prompts, params)
    for path in (target, draft):
        spec_llm = llm(target, speculative=f"draft={path}")
        spec = generate(spec_llm, prompts, params)
        assert tokens(spec) == tokens(base)
        drafts = sum(r.num_draft_tokens for r in spec)
        if path == target:
            assert drafts > 0 and accepted(spec) >= 0.9 * drafts


def test_unseeded_sampling_uses_the_drafts_distribution(models: tuple[str, str]) -> None:
    """A draft of the model itself, sampling at temperature 1: q equals p, so rejection
    sampling keeps (almost) every guess (a rule that compared the guess with an independent
    draw of the model would keep about sum p^2 of them)."""
    target, _ = models
    spec = llm(target, speculative=f"draft={target}")
    out = generate(spec, [PROMPTS[1]] * 4, SamplingParams(temperature=1.0, max_tokens=24))
    drafts = sum(r.num_draft_tokens for r in out)
    assert drafts > 0 and accepted(out) >= 0.9 * drafts


def test_sampling_distribution_is_kept_with_a_poor_draft(
    peaked: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """Unseeded samples at temperature 1 with top-p, 1,500 with a poor draft model and 1,500
    without, agree at every output position (chi-square of the two samples' token counts,
    p > 1e-3). Accepting with min(1, 2 p(g) / q(g)), or drawing a refused row from p instead
    of max(0, p - q), fails this."""
    target = peaked  # (seed 3, its logits times 3)
    draft = str(layer_skip_draft(tmp_path_factory.mktemp("peaked-draft"), seed=3, scale=3.0))
    n, length = 1500, 4
    params = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=length, ignore_eos=True)
    settings = {"max_num_batched_tokens": 1024, "max_num_seqs": 64}
    base = generate(llm(target, **settings, seed=1), [PROMPTS[2]] * n, params)
    spec_llm = LLM(
        target, speculative=f"draft={draft}", num_speculative_tokens=3, kv_cache_memory=SMALL_KV,
        speculative_disable_batch_size=64, seed=2, **settings,
    )
    spec_llm.frontend.core.speculator.adaptive = False  # type: ignore[union-attr]
    spec = generate(spec_llm, [PROMPTS[2]] * n, params)
    checked = sum(r.num_draft_tokens for r in spec)
    assert 0.1 * checked < accepted(spec) < 0.9 * checked  # a poor draft, not a useless one
    assert_same_distribution(base, spec, length)


def test_the_draft_gives_way_in_a_small_pool(models: tuple[str, str]) -> None:
    """A draft pool that holds about one request: states of requests not asking now are
    pushed out, and a request that still does not fit goes without guesses; outputs stay."""
    target, draft = models
    spec_llm = LLM(target, speculative=f"draft={draft}", kv_cache_memory=SMALL_KV)
    proposer = draft_of(spec_llm)
    proposer.pool = FreeBlocks(7)
    out = generate(spec_llm, PROMPTS)
    assert tokens(out) == tokens(generate(llm(target), PROMPTS))
    assert sum(r.num_draft_tokens for r in out) > 0
    assert_draft_blocks_free(spec_llm)


def test_a_draft_with_another_tokenizer_is_refused(
    models: tuple[str, str], tmp_path: Path
) -> None:
    target, draft = models
    other = tmp_path / "other"
    other.mkdir()
    for name in ("config.json", "model.safetensors", "generation_config.json"):
        (other / name).write_bytes((Path(draft) / name).read_bytes())
    tokenizer = make_tiny_tokenizer()
    tokenizer.add_tokens(["<extra_token>"])
    tokenizer.save_pretrained(other)
    with pytest.raises(ValueError, match="draft's tokenizer differs from the model's.*<extra_token>"):
        LLM(target, speculative=f"draft={other}", kv_cache_memory=SMALL_KV)
    with pytest.raises(ValueError, match="speculative must be one of"):
        LLM(target, speculative="draft=")
