"""The start-up warm-up (engine/warmup.py): dummy requests of every planned length run through
the runner, and the engine afterwards is as a fresh one: no request, every KV block free,
nothing in the prefix cache, zero counters, and the same outputs (greedy and seeded) as an
engine that never warmed up. Off by default on the CPU; it fits a small KV cache and context."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from mmserve.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from mmserve.engine import warmup
from mmserve.engine.engine_core import EngineCore
from mmserve.params import SamplingParams
from mmserve.request import Request
from tests.engine.conftest import assert_all_blocks_free, run_all
from tests.fake_model import FakeModel


def _core(warm: bool | None, num_blocks: int = 128, budget: int = 64, max_len: int = 512) -> EngineCore:
    config = EngineConfig(
        model=ModelConfig(model="fake", warmup=warm),
        cache=CacheConfig(block_size=4, num_blocks=num_blocks),
        scheduler=SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=8),
    )
    return EngineCore(config, FakeModel(), max_len, torch.device("cpu"), torch.float32)


def _requests() -> list[Request]:
    greedy = SamplingParams(max_tokens=6, temperature=0.0)
    seeded = SamplingParams(max_tokens=6, temperature=1.0, seed=3)
    prompt = [1, 2, 3, 4, 5, 6, 7, 8, 9]  # two full blocks: a prefix-cache entry if one were left
    return [
        Request("a", prompt, greedy, frozenset(), 6),
        Request("b", prompt + [10], seeded, frozenset(), 6),
    ]


def test_a_warmed_engine_is_a_fresh_one(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[list[int]] = []
    original = warmup.Request

    def record(request_id, prompt, *args, **kwargs):  # type: ignore[no-untyped-def]
        seen.append(prompt)
        return original(request_id, prompt, *args, **kwargs)

    monkeypatch.setattr(warmup, "Request", record)
    warmed = _core(True)
    lens = sorted({len(p) for p in seen})
    assert lens == [1, 3, 7, 16, 31, 64 + 17, 100]  # 512 does not fit half the 512-token cache
    assert warmed.warmup_seconds > 0
    assert not warmed.has_unfinished and not warmed.scheduler.requests
    assert_all_blocks_free(warmed)
    stats = warmed.stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits, stats.num_preemptions) == (0, 0, 0)
    assert not warmed.kv.pool._cached  # nothing the dummies computed is found again
    cold = _core(None)
    assert cold.warmup_seconds == 0.0  # off on the CPU unless asked for
    assert run_all(warmed, _requests()) == run_all(cold, _requests())
    assert warmed.stats().prefix_cache_queries == cold.stats().prefix_cache_queries


def test_it_fits_a_small_cache_and_context() -> None:
    core = _core(True, num_blocks=8, budget=16, max_len=20)  # 32 cache tokens, 20 context
    assert_all_blocks_free(core)
    assert run_all(core, _requests()[:1])["a"]


def test_a_warm_up_that_cannot_finish_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(warmup, "MAX_STEPS", 3)
    with pytest.raises(RuntimeError, match="did not finish"):
        _core(True)


def test_the_setting_reaches_the_engine() -> None:
    from mmserve.settings import settings_of

    (s,) = [s for s in settings_of(ModelConfig) if s.name == "warmup"]
    assert s.is_bool and s.default is None and s.flag == "--warmup"
    config = replace(ModelConfig(model="m"), warmup=False)
    assert config.warmup is False


def test_late_compiles_are_counted_and_the_first_logged(caplog, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """After start-up, Triton's post-compile hook counts each compile and logs the first
    LOGGED_COMPILES with the kernel's description; an installed hook is left alone."""
    import logging

    from triton import knobs

    from mmserve.engine import warmup

    monkeypatch.setattr(knobs.runtime, "jit_post_compile_hook", None)
    monkeypatch.setattr(warmup, "LOGGED_COMPILES", 2)
    watch = warmup.watch_late_compiles()
    assert watch is not None and knobs.runtime.jit_post_compile_hook is watch
    from triton.runtime.jit import JitFunctionInfo

    with caplog.at_level(logging.WARNING, logger="mmserve.engine.warmup"):
        for i in range(3):
            # the hook's arguments as Triton's JITFunction._call_hook passes them: many pointers,
            # then the integer that was specialised (divisible by 16) and constexprs
            names = [f"p{j}" for j in range(40)] + ["num_reqs", "n", "BLOCK"]
            types = ["*fp32"] * 40 + ["i32", "i32", "constexpr"]
            attrs = {(j,): [["tt.divisibility", 16]] for j in range(40)}
            attrs |= {(40,): [["tt.divisibility", 16]], (41,): []}
            compile_ = {"signature": dict(zip(names, types)), "constants": {(42,): 64},
                        "configs": [attrs], "num_warps": 4, "num_stages": 3}  # fmt: skip
            fn = JitFunctionInfo(None, f"_kernel_{i}", None)  # type: ignore[arg-type]
            watch(key="k", repr=f"_kernel_{i}[num_warps=4](p0: (", fn=fn, compile=compile_)
        watch(key="k", repr="_old[num_warps=4](x: (\n 'i32'))", fn=None, compile={})
    assert watch.count == 4
    logged = [r.getMessage() for r in caplog.records if "compiled while serving" in r.getMessage()]
    assert len(logged) == 2 and "_kernel_0[num_warps=4, num_stages=3](" in logged[0]
    assert "_kernel_1" in logged[1] and "\n" not in logged[0]
    assert "p39:*fp32[tt.divisibility=16]" in logged[0]
    assert "num_reqs:i32[tt.divisibility=16], n:i32, BLOCK=64)" in logged[0]
    monkeypatch.setattr(warmup, "LOGGED_COMPILES", 5)
    with caplog.at_level(logging.WARNING, logger="mmserve.engine.warmup"):
        watch(key="k", repr="_old[num_warps=4](x: (\n 'i32'))", fn=None, compile={})
    assert "_old[num_warps=4](x: ( 'i32'))" in caplog.records[-1].getMessage()  # no data: the repr
    assert warmup.watch_late_compiles() is None  # a hook is installed: not replaced
    assert knobs.runtime.jit_post_compile_hook is watch


def test_grammar_masks_are_warmed_at_each_row_count(monkeypatch: pytest.MonkeyPatch) -> None:
    """warm_grammar_masks applies masks on 1, 2 and 16 rows (Triton's three specialisations of
    the row count), masks that allow everything: the logits stay as they were."""
    seen: list[tuple[int, list[int], torch.Tensor]] = []
    original = warmup.apply_bitmask

    def record(logits, bitmask, rows, *args):  # type: ignore[no-untyped-def]
        before = logits.clone()
        original(logits, bitmask, rows, *args)
        seen.append((logits.shape[1], list(rows), before))
        assert torch.equal(logits, before)

    monkeypatch.setattr(warmup, "apply_bitmask", record)
    warmup.warm_grammar_masks(torch.device("cpu"), 1000)
    assert [(v, len(rows)) for v, rows, _ in seen] == [(1000, 1), (1000, 2), (1000, 16)]
    assert all(rows == list(range(len(rows))) for _, rows, _ in seen)


def test_an_engine_that_takes_grammars_warms_their_masks(
    tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:  # type: ignore[no-untyped-def]
    """With the warm-up on, an engine with a structured-output manager warms the mask kernel
    for its model's vocabulary; with the warm-up off it does not."""
    from mmserve import LLM
    from tests.utils.tiny_models import make_tiny_model

    calls: list[int] = []
    monkeypatch.setattr(warmup, "warm_grammar_masks", lambda device, vocab: calls.append(vocab))
    folder = str(make_tiny_model(tmp_path, arch="llama"))
    llm = LLM(folder, kv_cache_memory=16 << 20, warmup=True)
    assert calls == [llm.frontend.core.runner.model.vocab_size]
    LLM(folder, kv_cache_memory=16 << 20, warmup=False)
    assert len(calls) == 1


def test_few_row_waves_come_where_they_fit(monkeypatch: pytest.MonkeyPatch) -> None:
    """With room for them, 2, 3 and 4 prompts of ROWS_PROMPT_LEN come at once (a step that
    samples that many rows), between the single prompts and the wave of all; the engine is
    fresh afterwards."""
    waves: dict[str, list[int]] = {}
    original = warmup.Request

    def record(request_id, prompt, *args, **kwargs):  # type: ignore[no-untyped-def]
        waves.setdefault(request_id.rsplit("-", 1)[0], []).append(len(prompt))
        return original(request_id, prompt, *args, **kwargs)

    monkeypatch.setattr(warmup, "Request", record)
    core = _core(True, num_blocks=1200, budget=4096, max_len=2048)  # 4,800 cache tokens
    n = warmup.ROWS_PROMPT_LEN
    order = list(waves.values())
    assert [lens for lens in order if set(lens) == {n}] == [[n] * 2, [n] * 3, [n] * 4]
    assert all(len(lens) == 1 for lens in order[: order.index([n] * 2)])  # the single prompts first
    assert order[-1] == [1, 3, 7, 16, 31, 100, 512, 1041]  # then all at once (4096 + 17 is too long)
    assert_all_blocks_free(core)
    assert not core.scheduler.requests
