"""--cpu-gguf-activations int8: a GGUF's projections on the CPU meet int8 activations
(mmserve/kernels/cpu/gguf_q8.c). A tiny Llama written as llama.cpp writes it, in each type,
loaded with the setting: every projection and the (tied or untied) head, given the inputs that
transformers' own GGUF load feeds its layers, gives the int8-activation arithmetic's outputs
(gguf_matmul_dp4a_ref on the file's blocks), measurably not the float32 product's; the model's
logits differ from the float32 default's, which still gives transformers' own.

The projections are compared on the same inputs, not the logits end to end: an input that
differs in its last bits (another order of float32 sums in attention) can round to the next
int8 step, a jump the next layers carry to the logits (with random O(1) weights, up to 0.1)."""

from __future__ import annotations

from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch
from torch import nn

from mmserve.attention.torch_ref import TorchAttentionBackend
from mmserve.config import ModelConfig
from mmserve.kernels import cpu_gguf
from mmserve.kernels.gguf_gemm import gguf_matmul_dp4a_ref
from mmserve.models import loader
from mmserve.models.gguf import iter_gguf_blocks
from mmserve.models.gguf_linear import (
    SUPPORTED_TYPES,
    GgufLinear,
    block_type,
    gguf_quantization,
    takes_int8_activations,
)
from tests.models.gguf_reference import transformers_from_gguf
from tests.models.paged import PagedKV, PagedSeq
from tests.utils.tiny_gguf import write_tiny_gguf
from tests.utils.tiny_models import make_tiny_model

IDS = [1, 17, 42, 99, 5, 300, 7, 250, 64, 12]
pytestmark = pytest.mark.skipif(
    not cpu_gguf.q8_supported("Q4_0"), reason="no C library with AVX-512 VNNI here"
)


@pytest.fixture(autouse=True)
def _cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MMSERVE_CACHE_DIR", str(tmp_path / "cache"))


@torch.no_grad()
def _ours(path: Path, activations: str) -> tuple[torch.Tensor, Any]:
    config = ModelConfig(model=str(path), cpu_gguf_activations=activations)
    with mock.patch.object(loader, "_keeps_gguf_blocks", return_value=True):
        model, _, _ = loader.load_model(config, "cpu", "float32", TorchAttentionBackend())
    return PagedKV(model, num_blocks=16).step(model, [(PagedSeq(), IDS)]), model


class _Int8Product(nn.Module):
    """A transformers projection replaced by the int8-activation arithmetic on blocks."""

    def __init__(self, blocks: torch.Tensor) -> None:
        super().__init__()
        self.blocks, self.qtype = blocks, block_type(blocks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        assert self.qtype is not None
        flat = x.reshape(-1, x.shape[-1])
        return gguf_matmul_dp4a_ref(flat, self.blocks, self.qtype).view(*x.shape[:-1], -1)


# our merged projections -> transformers' modules whose outputs they concatenate
_MERGED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


@torch.no_grad()
def _transformers_int8(path: Path) -> dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """transformers' GGUF load with each projection (and the head) replaced by the int8
    arithmetic on the file's blocks, run on IDS: each projection's input, output and weight
    (the float32 one transformers loaded)."""
    model = transformers_from_gguf(path.parent, path.name)
    blocks = dict(iter_gguf_blocks(path, model.config, set(), SUPPORTED_TYPES))
    seen: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
    for name, module in list(model.named_modules()):
        if isinstance(module, nn.Linear):
            weight = blocks.get(f"{name}.weight")
            if weight is None:  # a tied head: the embedding's blocks
                weight = blocks["model.embed_tokens.weight"]
            product = _Int8Product(weight)
            product.register_forward_hook(
                lambda _m, args, out, name=name, w=module.weight: seen.__setitem__(name, (args[0][0], out[0], w))
            )
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, child, product)
    model(torch.tensor([IDS]))
    return seen


@pytest.mark.parametrize(
    ("qtype", "overrides"),
    [
        ("Q4_0", {}),
        ("Q4_1", {"tie_word_embeddings": True}),
        ("Q5_0", {}),
        ("Q5_1", {}),
        ("Q8_0", {}),
        ("Q4_K", {"hidden_size": 256, "intermediate_size": 512, "head_dim": 64}),  # Q6_K head
    ],
)
@torch.no_grad()
def test_int8_activations_give_the_int8_arithmetics_products(
    tmp_path: Path, qtype: str, overrides: dict[str, Any]
) -> None:
    path = write_tiny_gguf(make_tiny_model(tmp_path, "llama", **overrides), qtype)
    ours, model = _ours(path, "int8")
    products = {n: m for n, m in model.named_modules() if isinstance(m, GgufLinear)}
    assert len(products) == 4 * 2 + 1 and all(p.parts and all(part.int8 for part in p.parts) for p in products.values())
    kept = "gguf:Q4_K+Q6_K" if qtype == "Q4_K" else f"gguf:{qtype}"  # (the file's types, by their bytes)
    assert gguf_quantization(model) == kept
    seen = _transformers_int8(path)
    for name, product in products.items():
        stem, _, leaf = name.rpartition(".")
        theirs = [f"{stem}.{part}" if stem else part for part in _MERGED.get(leaf, (leaf,))]
        x = seen[theirs[0]][0]
        expected = torch.cat([seen[t][1] for t in theirs], dim=-1)
        out = product(x)
        scale = expected.abs().max().item()
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5 * scale, msg=name)
        exact = x.double() @ torch.cat([seen[t][2] for t in theirs]).double().t()
        assert (exact - expected).abs().max().item() > 1e-3 * scale, name
    floats, float_model = _ours(path, "float32")
    assert not any(part.int8 for m in float_model.modules() if isinstance(m, GgufLinear) for part in m.parts)
    assert takes_int8_activations(model) and not takes_int8_activations(float_model)
    torch.testing.assert_close(floats, _transformers(path), atol=1e-4, rtol=1e-4)
    assert (floats - ours).abs().max().item() > 1e-3


@torch.no_grad()
def _transformers(path: Path) -> torch.Tensor:
    return transformers_from_gguf(path.parent, path.name)(torch.tensor([IDS])).logits[0]


def test_a_tied_head_leaves_the_embedding_its_blocks(tmp_path: Path) -> None:
    path = write_tiny_gguf(make_tiny_model(tmp_path, "llama", tie_word_embeddings=True), "Q8_0")
    _, model = _ours(path, "int8")
    embedding, head = model.model.embed_tokens, model.lm_head
    assert head.parts[0].int8 and embedding.table.dim() == 3  # the file's blocks, still
    assert head.get_buffer("part0") is not embedding.table
    assert "a8" in repr(head)


def test_the_setting_is_checked() -> None:
    with pytest.raises(ValueError, match="cpu_gguf_activations must be one of"):
        ModelConfig(model="m", cpu_gguf_activations="int4")


def test_a_load_the_setting_cannot_apply_to_says_so(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A GGUF dequantised at load (here: its blocks not kept) with the setting loads as without
    it, and the log says why; a model that is no GGUF (an embedding model served beside one)
    loads without a word."""
    import logging

    folder = make_tiny_model(tmp_path, "llama")
    path = write_tiny_gguf(folder, "Q8_0")
    config = ModelConfig(model=str(path), cpu_gguf_activations="int8")
    with (
        caplog.at_level(logging.WARNING, logger=loader.__name__),
        mock.patch.object(loader, "_keeps_gguf_blocks", return_value=False),
    ):
        model, _, _ = loader.load_model(config, "cpu", "float32", TorchAttentionBackend())
    assert not any(isinstance(m, GgufLinear) for m in model.modules())
    assert "--cpu-gguf-activations int8 applies to a GGUF kept in its blocks" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=loader.__name__):
        loader.load_model(
            ModelConfig(model=str(folder), cpu_gguf_activations="int8"), "cpu", "float32", TorchAttentionBackend()
        )
    assert "cpu-gguf-activations" not in caplog.text
