from __future__ import annotations

import torch

from mmserve.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from mmserve.engine.engine_core import EngineCore
from mmserve.params import SamplingParams
from mmserve.request import Request
from tests.fake_model import FakeModel


def make_core(
    model: FakeModel | None = None,
    num_blocks: int = 64,
    block_size: int = 4,
    budget: int = 256,
    max_seqs: int = 16,
    caching: bool = True,
    async_scheduling: bool = True,
) -> EngineCore:
    config = EngineConfig(
        model=ModelConfig(model="fake"),
        cache=CacheConfig(block_size=block_size, num_blocks=num_blocks, enable_prefix_caching=caching),
        scheduler=SchedulerConfig(
            max_num_batched_tokens=budget, max_num_seqs=max_seqs, async_scheduling=async_scheduling
        ),
    )
    return EngineCore(config, model or FakeModel(), 512, torch.device("cpu"), torch.float32)


def make_request(rid: str, prompt: list[int], max_tokens: int = 8, **params: object) -> Request:
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, **params)  # type: ignore[arg-type]
    return Request(rid, list(prompt), sp, eos_token_ids=frozenset(), max_tokens=max_tokens)


def run_all(core: EngineCore, requests: list[Request], max_steps: int = 10_000) -> dict[str, list[int]]:
    """Adds the requests, steps until all finish; returns each request's output tokens."""
    for r in requests:
        core.add(r)
    out: dict[str, list[int]] = {r.request_id: [] for r in requests}
    for _ in range(max_steps):
        if not core.has_unfinished:
            break
        for o in core.step():
            out[o.request_id] += o.new_token_ids
    assert not core.has_unfinished
    return out


def assert_all_blocks_free(core: EngineCore) -> None:
    pool = core.kv.pool
    assert pool.num_free_blocks == pool.num_blocks
    assert all(b.ref_cnt == 0 for b in pool.blocks)
