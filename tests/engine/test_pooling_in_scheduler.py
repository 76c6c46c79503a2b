"""Pooling requests share steps with generation and give the same result as alone."""

from __future__ import annotations

import torch

from mmserve.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from mmserve.engine.engine_core import EngineCore
from mmserve.params import PoolingParams, SamplingParams
from mmserve.request import Request
from tests.engine.conftest import assert_all_blocks_free, make_request
from tests.fake_model import FakeModel

MODEL = FakeModel()


def mean_pool(hidden: torch.Tensor, params: PoolingParams) -> torch.Tensor:
    return hidden.mean(0)


def pool_request(rid: str, prompt: list[int]) -> Request:
    return Request(rid, prompt, SamplingParams(max_tokens=1), frozenset(), 0, pooling=PoolingParams())


def core(budget: int) -> EngineCore:
    config = EngineConfig(
        model=ModelConfig(model="fake"),
        cache=CacheConfig(block_size=4, num_blocks=64),
        scheduler=SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=8),
    )
    return EngineCore(config, MODEL, 512, torch.device("cpu"), torch.float32, pooler=mean_pool)


def test_pooling_and_generation_share_steps() -> None:
    c = core(budget=24)
    gen = make_request("g", list(range(1, 30)), max_tokens=6)
    pools = [pool_request(f"p{i}", [i + 1] * (5 + 3 * i)) for i in range(4)]
    c.add(gen)
    for p in pools:
        c.add(p)
    mixed_steps = 0  # steps whose batch holds both a pooling and a generating request
    launch = c.runner.launch

    def spy(plan):  # type: ignore[no-untyped-def]
        nonlocal mixed_steps
        kinds = {s.pooling is None for s in plan.scheduled}
        mixed_steps += kinds == {True, False}
        return launch(plan)

    c.runner.launch = spy  # type: ignore[method-assign]
    pooled, tokens = {}, []
    while c.has_unfinished:
        for o in c.step():
            tokens += o.new_token_ids
            if o.pooled is not None:
                pooled[o.request_id] = o.pooled
                assert o.finish_reason == "stop" and o.num_prompt_tokens > 0
    assert tokens == MODEL.reference_greedy(list(range(1, 30)), 6)
    for p in pools:
        ref = MODEL.reference_hidden(p.prompt_token_ids).mean(0)
        torch.testing.assert_close(pooled[p.request_id], ref, rtol=1e-5, atol=1e-5)
    assert mixed_steps > 0
    assert_all_blocks_free(c)


def test_pooling_request_longer_than_budget_runs_alone() -> None:
    c = core(budget=8)
    p = pool_request("p", list(range(1, 21)))
    c.add(p)
    outs = c.step() + c.step()  # one step computes all 20 tokens (async: the next returns them)
    assert not c.has_unfinished
    assert len(outs) == 1 and outs[0].pooled is not None
    ref = MODEL.reference_hidden(p.prompt_token_ids).mean(0)
    torch.testing.assert_close(outs[0].pooled, ref, rtol=1e-5, atol=1e-5)


def test_a_pooling_input_leaves_nothing_in_the_prefix_cache() -> None:
    """A pooling input carries no tenant's salt: its blocks are never cached, so no later
    generation can hit (and time) another caller's text."""
    c = core(budget=64)
    prompt = list(range(1, 30))
    c.add(pool_request("p", prompt))
    while c.has_unfinished:
        c.step()
    assert c.kv.pool.num_cached_blocks == 0
    gen = make_request("g", prompt, max_tokens=2)
    c.add(gen)
    while c.has_unfinished:
        c.step()
    assert gen.num_cached_tokens == 0
    assert_all_blocks_free(c)
