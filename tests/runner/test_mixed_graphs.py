"""The engine's steps with prefill tokens through MixedGraphs (the CUDA graphs of small
prefills, prefix hits and mixed steps; on the CPU the same padded forward runs eagerly): the
tokens and logprobs of an engine without them, with prefix-cache hits, chunked prefill beside
decodes and seeded sampling, and every KV block back; steps too large for a graph run as
before."""

from __future__ import annotations

import pytest

from mmserve import LLM, SamplingParams
from mmserve.runner.cuda_graphs import MixedGraphs
from tests.engine.conftest import assert_all_blocks_free
from tests.utils.tiny_models import make_tiny_model

SYSTEM = "You are a careful assistant. Answer briefly and cite the page. " * 3
PROMPTS = [SYSTEM + "What is paged attention?", SYSTEM + "Why chunk a prefill?", "hi", SYSTEM + "ok"]
PARAMS = [
    SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2),
    SamplingParams(temperature=0.9, top_p=0.9, seed=3, max_tokens=12, ignore_eos=True),
]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(make_tiny_model(tmp_path_factory.mktemp("mixed"), arch="llama"))


def _run(llm: LLM) -> list[tuple[list[int], list[float]]]:
    out = []
    cached = 0
    for i, prompt in enumerate(PROMPTS):  # one after another: the later ones hit the prefix cache
        request = llm.generate([prompt], PARAMS[i % 2], use_tqdm=False)[0]
        r, cached = request.outputs[0], cached + request.num_cached_tokens
        out.append((list(r.token_ids), [lp.logprob for lp in r.logprobs or []]))
    assert cached > len(SYSTEM) // 4  # (the system prompt's blocks, found again)
    both = llm.generate(PROMPTS, PARAMS[0], use_tqdm=False)  # together: chunks beside decodes
    out += [(list(r.outputs[0].token_ids), []) for r in both]
    return out


def test_an_engine_with_mixed_graphs_gives_the_same_outputs(tiny: str) -> None:
    settings = {"kv_cache_memory": 16 << 20, "max_num_batched_tokens": 48}
    expected = _run(LLM(tiny, **settings))  # type: ignore[arg-type]
    llm = LLM(tiny, **settings)  # type: ignore[arg-type]
    runner = llm.frontend.core.runner
    assert runner.mixed_graphs is None  # (captured on CUDA only)
    graphs = MixedGraphs(
        runner.model, runner.kv_caches, 48, 8, 64, llm.frontend.max_model_len, runner.device,
        sizes=(16, 32, 48),
    )
    runner.mixed_graphs = graphs
    calls = {"taken": 0, "refused": 0}
    run = graphs.run

    def counted(*args: object) -> object:
        hidden = run(*args)  # type: ignore[arg-type]
        calls["taken" if hidden is not None else "refused"] += 1
        return hidden

    graphs.run = counted  # type: ignore[method-assign]
    got = _run(llm)
    for (tokens, logprobs), (want_tokens, want_logprobs) in zip(got, expected, strict=True):
        assert tokens == want_tokens
        assert logprobs == pytest.approx(want_logprobs, abs=1e-5)
    assert calls["taken"] > 0
    assert_all_blocks_free(llm.frontend.core)


def test_the_prefill_graph_setting_caps_the_sizes(tiny: str) -> None:
    """prefill_graph_tokens (a setting; 0 = none) bounds the captured sizes with the step
    budget; a negative one is refused, naming it."""
    from mmserve.config import ModelConfig
    from mmserve.runner.cuda_graphs import MIXED_TOKEN_SIZES

    assert ModelConfig(model="m").prefill_graph_tokens_for("") == 256
    with pytest.raises(ValueError, match="prefill_graph_tokens must be >= 0"):
        ModelConfig(model="m", prefill_graph_tokens=-1)
    llm = LLM(tiny, kv_cache_memory=16 << 20, prefill_graph_tokens=100)
    assert llm.frontend.core.config.model.prefill_graph_tokens == 100
    runner = llm.frontend.core.runner
    for cap, want in ((100, [s for s in MIXED_TOKEN_SIZES if s <= 100]), (0, [])):
        graphs = MixedGraphs(runner.model, runner.kv_caches, cap, 8, 64, 256, runner.device)
        assert graphs.sizes == want


@pytest.mark.parametrize(
    ("quantization", "setting", "want"),
    [(None, None, 256), ("fp8", None, 1024), ("int8", None, 1024), ("fp8", 100, 100), (None, 0, 0)],
)
def test_the_prefill_graph_default_follows_the_scheme(
    tiny: str, monkeypatch: pytest.MonkeyPatch, quantization: str | None, setting: int | None, want: int
) -> None:
    """Unset, prefill_graph_tokens is 256, and 1024 for a model run with FP8 or INT8 weights
    and activations (their eager prefills are bound by launches); a set value wins. The
    engine hands the resolved value to the runner's capture."""
    from mmserve.runner.model_runner import ModelRunner

    seen: list[int] = []
    capture = ModelRunner.capture_graphs

    def record(self: ModelRunner, *args: object) -> None:
        seen.append(args[4])  # type: ignore[arg-type]
        capture(self, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(ModelRunner, "capture_graphs", record)
    LLM(tiny, kv_cache_memory=16 << 20, quantization=quantization, prefill_graph_tokens=setting)
    assert seen == [want]
