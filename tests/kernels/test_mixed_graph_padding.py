"""MixedGraphs' padded step (pad tokens that write no cache, empty requests of seq_len 0,
max_query_len frozen at the size) through the Triton attention backend gives every real row
the hidden state of the unpadded step, and writes the same KV cache: a first short prefill, a
prefix hit (many cached tokens, a few new), prefill chunks with decodes beside them. On CUDA
the captured graphs replay exactly this forward; an engine with them (eager here) gives the
tokens of one without (tests/runner)."""

from __future__ import annotations

import pytest
import torch

from mmserve.attention import get_attention_backend
from mmserve.attention.backend import AttentionMetadata
from mmserve.config import ModelConfig
from mmserve.models.loader import load_model
from mmserve.runner.cuda_graphs import MixedGraphs
from tests.kernels.conftest import DEVICE
from tests.utils.tiny_models import make_tiny_model

BLOCK = 4
NUM_BLOCKS = 64
# each request: (context tokens already cached, new tokens this step)
STEPS = [
    [(0, 5)],  # a short prompt
    [(40, 9)],  # a prefix hit: 40 tokens cached, the user's turn new
    [(6, 1), (19, 1), (16, 12), (32, 1)],  # decodes beside a prefill chunk
    [(0, 16), (3, 14)],  # exactly a size's tokens
]


def _step(requests: list[tuple[int, int]], gen: torch.Generator) -> tuple[AttentionMetadata, torch.Tensor]:
    """The step's metadata (each request's blocks its own, at random) and positions."""
    qlens = [n for _, n in requests]
    seq_lens = [c + n for c, n in requests]
    width = -(-max(seq_lens) // BLOCK)
    blocks = torch.randperm(NUM_BLOCKS, generator=gen)[: width * len(requests)].view(len(requests), width)
    slots, positions = [], []
    for r, (context, n) in enumerate(requests):
        for p in range(context, context + n):
            slots.append(int(blocks[r, p // BLOCK]) * BLOCK + p % BLOCK)
            positions.append(p)
    starts = torch.tensor([0, *qlens], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    meta = AttentionMetadata(
        query_start_loc=starts.to(DEVICE),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
        block_tables=blocks.to(torch.int32).to(DEVICE),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=DEVICE),
        max_query_len=max(qlens),
        max_seq_len=max(seq_lens),
        query_lens_cpu=qlens,
        seq_lens_cpu=seq_lens,
    )
    return meta, torch.tensor(positions, dtype=torch.int64, device=DEVICE)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    path = make_tiny_model(tmp_path_factory.mktemp("mixed"), arch="llama")
    model, hf_config, _ = load_model(
        ModelConfig(model=str(path)), DEVICE, "float32", get_attention_backend("triton")
    )
    return model, hf_config


def _caches(model, gen: torch.Generator) -> list[torch.Tensor]:  # type: ignore[no-untyped-def]
    """KV caches of random contents: the cached context every request reads."""
    shape = (2, NUM_BLOCKS, BLOCK, model.num_kv_heads, model.head_dim)
    return [torch.randn(shape, generator=gen).to(DEVICE) for _ in range(model.num_layers)]


@pytest.mark.parametrize("requests", STEPS, ids=str)
def test_padded_step_equals_unpadded(tiny, requests: list[tuple[int, int]]) -> None:  # type: ignore[no-untyped-def]
    model, hf_config = tiny
    gen = torch.Generator().manual_seed(len(requests))
    caches = _caches(model, gen)
    before = [c.clone() for c in caches]
    expected_caches = [c.clone() for c in caches]
    meta, positions = _step(requests, gen)
    input_ids = torch.randint(0, hf_config.vocab_size, (positions.shape[0],), generator=gen).to(DEVICE)
    expected = model.forward(input_ids, positions, expected_caches, meta)
    graphs = MixedGraphs(model, caches, max_tokens=64, max_reqs=8, max_blocks_per_seq=16,
                         max_seq_len=64, device=DEVICE, sizes=(16, 32, 64))  # fmt: skip
    got = graphs.run(input_ids, positions, meta)
    assert got is not None and got.shape == expected.shape
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-5)
    for layer, (mine, theirs, old) in enumerate(zip(caches, expected_caches, before, strict=True)):
        # the same slots written (the pad tokens none), with the same values
        assert torch.equal(mine != old, theirs != old), f"layer {layer}: other cache slots written"
        torch.testing.assert_close(mine, theirs, atol=2e-5, rtol=1e-5)
    size = next(s for s in graphs.sizes if s >= positions.shape[0])
    assert size > positions.shape[0] or graphs.reqs_for(size) > len(requests)  # padding ran


def test_steps_no_graph_fits_are_refused(tiny) -> None:  # type: ignore[no-untyped-def]
    model, _ = tiny
    gen = torch.Generator().manual_seed(7)
    graphs = MixedGraphs(model, _caches(model, gen), max_tokens=32, max_reqs=4, max_blocks_per_seq=8,
                         max_seq_len=32, device=DEVICE, sizes=(16, 32, 64))  # fmt: skip
    assert graphs.sizes == [16, 32]  # none past the step budget
    too_many_tokens, positions = _step([(0, 33)], gen)
    ids = torch.zeros(positions.shape[0], dtype=torch.int64, device=DEVICE)
    assert graphs.run(ids, positions, too_many_tokens) is None
    too_many_requests, positions = _step([(0, 1)] * 5, gen)
    assert graphs.run(ids[:5], positions, too_many_requests) is None
    too_long, positions = _step([(30, 3)], gen)  # 33 > max_seq_len
    assert graphs.run(ids[:3], positions, too_long) is None
    tiny_budget = MixedGraphs(model, _caches(model, gen), max_tokens=8, max_reqs=4, max_blocks_per_seq=8,
                              max_seq_len=32, device=DEVICE)  # fmt: skip
    short, positions = _step([(0, 5)], gen)
    assert tiny_budget.sizes == [] and tiny_budget.run(ids[:5], positions, short) is None
