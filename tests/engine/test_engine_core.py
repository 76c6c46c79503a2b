"""Chunked prefill, batching, preemption and prefix caching must never change greedy output."""

from __future__ import annotations

import random

import pytest

from tests.engine.conftest import assert_all_blocks_free, make_core, make_request, run_all
from tests.fake_model import FakeModel

MODEL = FakeModel()


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(MODEL.vocab_size) for _ in range(rng.randint(1, 40))] for _ in range(n)]


def expected(ps: list[list[int]], max_tokens: int = 8) -> dict[str, list[int]]:
    return {f"r{i}": MODEL.reference_greedy(p, max_tokens) for i, p in enumerate(ps)}


@pytest.mark.parametrize(
    "kwargs",
    [
        {},  # everything in one step
        {"budget": 5},  # tiny budget: long prompts chunked, mixed with decodes
        {"budget": 1},  # one token per step
        {"num_blocks": 14, "budget": 16},  # tiny KV pool: preemption by recompute
        {"max_seqs": 2},  # cap on running requests
        {"caching": False},
    ],
)
def test_batched_equals_alone(kwargs: dict) -> None:
    ps = prompts(6)
    core = make_core(MODEL, **kwargs)
    out = run_all(core, [make_request(f"r{i}", p) for i, p in enumerate(ps)])
    assert out == expected(ps)
    assert_all_blocks_free(core)


def test_preemption_happens_and_recovers() -> None:
    ps = prompts(6, seed=3)
    core = make_core(MODEL, num_blocks=14, budget=64)
    reqs = [make_request(f"r{i}", p, max_tokens=12) for i, p in enumerate(ps)]
    out = run_all(core, reqs)
    assert sum(r.num_preemptions for r in reqs) > 0
    assert out == expected(ps, 12)
    assert_all_blocks_free(core)


def test_prefix_cache_hit_reports_cached_tokens_and_same_output() -> None:
    system = list(range(1, 34))  # 33 tokens: 8 full blocks of 4
    core = make_core(MODEL)
    first = run_all(core, [make_request("a", system + [5, 6])])
    r = make_request("b", system + [7, 8, 9])
    second = run_all(core, [r])
    assert r.num_cached_tokens == 32
    assert first["a"] == MODEL.reference_greedy(system + [5, 6], 8)
    assert second["b"] == MODEL.reference_greedy(system + [7, 8, 9], 8)
    assert core.kv.pool.num_cached_blocks > 0
    assert_all_blocks_free(core)


def test_full_prefix_hit_still_computes_last_token() -> None:
    p = list(range(1, 17))  # exactly 4 blocks
    core = make_core(MODEL)
    run_all(core, [make_request("a", p)])
    r = make_request("b", p)
    out = run_all(core, [r])
    assert r.num_cached_tokens == 12  # the last block is recomputed to sample
    assert out["b"] == MODEL.reference_greedy(p, 8)


def test_cache_salt_isolates() -> None:
    p = list(range(1, 30))
    core = make_core(MODEL)
    run_all(core, [make_request("a", p)])
    r = make_request("b", p)
    r.cache_salt = "tenant-2"
    run_all(core, [r])
    assert r.num_cached_tokens == 0


def test_cached_blocks_evicted_only_when_needed() -> None:
    core = make_core(MODEL, num_blocks=16)
    run_all(core, [make_request("a", list(range(1, 30)), max_tokens=2)])
    cached = core.kv.pool.num_cached_blocks
    assert cached == 7
    run_all(core, [make_request("b", [40, 41, 42], max_tokens=2)])  # fits in empty blocks
    assert core.kv.pool.num_cached_blocks == cached + 1
    # needs every block: cached prefixes must go, LRU
    big = make_request("c", [50 + i % 10 for i in range(60)], max_tokens=2)
    out = run_all(core, [big])
    assert out["c"] == MODEL.reference_greedy(big.prompt_token_ids, 2)
    assert_all_blocks_free(core)


def test_abort_frees_blocks_mid_prefill_and_mid_decode() -> None:
    core = make_core(MODEL, budget=8)
    a = make_request("a", list(range(1, 30)), max_tokens=50)
    b = make_request("b", [3, 4, 5], max_tokens=50)
    core.add(a)
    core.add(b)
    core.step()  # a is mid-prefill
    core.abort(["a"])
    for _ in range(3):
        core.step()
    assert len(b.output_token_ids) > 0
    core.abort(["b"])
    outs = core.step()
    assert {o.finish_reason for o in outs} == {"abort"}
    assert not core.has_unfinished
    assert_all_blocks_free(core)


def test_max_tokens_and_length_finish() -> None:
    core = make_core(MODEL)
    r = make_request("a", [1, 2, 3], max_tokens=5)
    core.add(r)
    reasons = []
    while core.has_unfinished:
        outs = core.step()
        reasons += [o.finish_reason for o in outs]
        assert all(r.arrival_time <= (o.first_scheduled_time or 0) for o in outs)
    assert reasons == [None] * 4 + ["length"]
    assert len(r.output_token_ids) == 5
