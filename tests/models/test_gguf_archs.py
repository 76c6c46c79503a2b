"""GGUF files of every architecture mmserve claims, written as llama.cpp's convert_hf_to_gguf.py
writes them (tests/utils/tiny_gguf.py) from tiny random HF models, loaded on the CPU as a default
load does (the blocks kept where the C kernels built) and with the floats dequantised at load:
the logits of transformers' own GGUF load, or of the HF model where transformers cannot load the
file (a qwen3 head_dim it misreads, a llama3 rope scaling it drops); and what the config takes
from the file that transformers' reader leaves at class defaults."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any
from unittest import mock

import numpy as np
import pytest
import torch

from mmserve.attention.torch_ref import TorchAttentionBackend
from mmserve.config import ModelConfig
from mmserve.errors import UnsupportedModel
from mmserve.models import loader
from mmserve.models.gguf import llama3_rope
from mmserve.models.gguf_linear import gguf_quantization
from mmserve.processors.tokenizer import load_tokenizer
from tests.models.gguf_reference import transformers_from_gguf
from tests.models.paged import PagedKV, PagedSeq
from tests.utils.tiny_gguf import llama3_rope_freqs, write_tiny_gguf
from tests.utils.tiny_models import make_tiny_model

IDS = [1, 17, 42, 99, 5, 300, 7, 250, 64, 12]


@pytest.fixture(autouse=True)
def _cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MMSERVE_CACHE_DIR", str(tmp_path / "cache"))


@torch.no_grad()
def _ours(path: Path, blocks: bool) -> tuple[torch.Tensor, Any, str]:
    with mock.patch.object(loader, "_keeps_gguf_blocks", return_value=blocks):
        model, hf_config, _ = loader.load_model(
            ModelConfig(model=str(path)), "cpu", "float32", TorchAttentionBackend()
        )
    return (
        PagedKV(model, num_blocks=16).step(model, [(PagedSeq(), IDS)]),
        hf_config,
        gguf_quantization(model),
    )


@torch.no_grad()
def _transformers(folder: Path, gguf_file: str | None = None) -> torch.Tensor:
    return transformers_from_gguf(folder, gguf_file)(torch.tensor([IDS])).logits[0]


@pytest.mark.parametrize(
    ("arch", "qtype", "overrides", "kept"),
    [
        ("llama", "Q8_0", {}, "gguf:Q8_0"),  # GQA, untied output.weight, q/k permuted
        ("mistral", "F32", {}, ""),  # arch "llama" in the file
        (
            "qwen2",
            "Q8_0",
            {"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}},
            "gguf:Q8_0",
        ),
        ("qwen2", "Q8_0", {"tie_word_embeddings": True}, "gguf:Q8_0"),  # no output.weight
        ("qwen3", "Q8_0", {"head_dim": 128}, "gguf:Q8_0"),
        (
            "qwen2",
            "Q4_K",
            {"hidden_size": 256, "intermediate_size": 512, "head_dim": 64},
            "gguf:Q4_K+Q6_K",
        ),
    ],
)
def test_each_architecture_gives_transformers_logits(
    tmp_path: Path, arch: str, qtype: str, overrides: dict[str, Any], kept: str
) -> None:
    path = write_tiny_gguf(make_tiny_model(tmp_path, arch, **overrides), qtype)
    expected = _transformers(path.parent, path.name)
    for blocks in (True, False):
        ours, _, quantization = _ours(path, blocks)
        torch.testing.assert_close(ours, expected, atol=1e-4, rtol=1e-4)
        assert quantization == (kept if blocks else "")


def test_qwen3_head_dim_is_the_files_key_length(tmp_path: Path) -> None:
    """transformers maps no qwen3.attention.key_length: its config keeps Qwen3Config's 128."""
    folder = make_tiny_model(tmp_path, "qwen3", head_dim=32)
    path = write_tiny_gguf(folder, "F32")
    ours, hf_config, _ = _ours(path, blocks=True)
    assert hf_config.head_dim == 32
    torch.testing.assert_close(ours, _transformers(folder), atol=1e-4, rtol=1e-4)


def test_a_llama_file_named_mistral_has_no_sliding_window(tmp_path: Path) -> None:
    """transformers reads general.name "mistral" as a MistralConfig, with its class's 4096
    window; the file states none, and llama.cpp applies none."""
    folder = make_tiny_model(tmp_path, "mistral")
    path = write_tiny_gguf(folder, "F32", name="mistral")
    ours, hf_config, _ = _ours(path, blocks=False)
    assert (hf_config.model_type, hf_config.sliding_window) == ("mistral", None)
    torch.testing.assert_close(ours, _transformers(folder), atol=1e-4, rtol=1e-4)


LLAMA3 = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 64}  # fmt: skip


@pytest.mark.parametrize("blocks", [False, True])  # True: built on the meta device
def test_a_llama3_rope_scaling_comes_back_from_rope_freqs(tmp_path: Path, blocks: bool) -> None:
    """llama.cpp keeps a llama3 scaling only as rope_freqs.weight (transformers drops it): the
    short original context makes it change these positions."""
    folder = make_tiny_model(
        tmp_path, "llama", rope_parameters=LLAMA3, max_position_embeddings=16384
    )
    path = write_tiny_gguf(folder, "F32")
    ours, hf_config, _ = _ours(path, blocks)
    assert hf_config.rope_parameters["rope_type"] == "llama3"
    torch.testing.assert_close(ours, _transformers(folder), atol=1e-4, rtol=1e-4)


def test_llama3_rope_of_llama_3_1s_rope_freqs() -> None:
    config = {"head_dim": 128, "rope_parameters": {**LLAMA3, "rope_theta": 500000.0,
              "original_max_position_embeddings": 8192}}  # fmt: skip
    freqs = llama3_rope_freqs(config).astype(np.float64)
    assert llama3_rope(freqs, 500000.0) == {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }  # fmt: skip
    assert llama3_rope(np.ones(64), 500000.0) is None
    with pytest.raises(UnsupportedModel, match="rope_freqs.weight .* is no llama3 rope scaling"):
        llama3_rope(freqs[::-1].copy(), 500000.0)


def test_a_gguf_beside_an_hf_tokenizer_keeps_its_own_special_tokens(tmp_path: Path) -> None:
    """convert_hf_to_gguf.py writes the GGUF into the HF folder by default; transformers given
    that folder and gguf_file reads its tokenizer.json and drops the GGUF's bos, eos and chat
    template."""
    folder = make_tiny_model(tmp_path, "llama")
    path = write_tiny_gguf(folder, "F32")
    alone = tmp_path / "alone"
    alone.mkdir()
    shutil.copy(path, alone / path.name)
    beside, expected = load_tokenizer(path), load_tokenizer(alone / path.name)
    assert (beside.bos_token, beside.eos_token) == ("<|im_start|>", "<|im_end|>")
    assert beside.chat_template == expected.chat_template is not None
    assert beside.get_vocab() == expected.get_vocab()


def test_a_type_without_cpu_kernels_is_dequantised_on_the_cpu(tmp_path: Path) -> None:
    """Q3_K (Q3_K_M files) has no CPU kernel: the CPU dequantises the file at load, as it did
    before it kept blocks, instead of refusing it."""
    k_quant_shape = {"hidden_size": 256, "intermediate_size": 512, "head_dim": 64}
    path = write_tiny_gguf(make_tiny_model(tmp_path, "llama", **k_quant_shape), "Q3_K")
    assert loader.unkept_types(path, loader.SUPPORTED_TYPES) == ["Q3_K"]
    model, _, _ = loader.load_model(
        ModelConfig(model=str(path)), "cpu", "float32", TorchAttentionBackend()
    )
    assert gguf_quantization(model) == ""  # no blocks kept
    ours = PagedKV(model, num_blocks=16).step(model, [(PagedSeq(), IDS)])
    torch.testing.assert_close(ours, _transformers(path.parent, path.name), atol=1e-4, rtol=1e-4)


def test_list_models_reads_the_scheme_from_the_file(tmp_path: Path) -> None:
    """general.file_type names the scheme whatever the file is called (`my-q8_0-model.gguf`,
    `model.gguf`); the file name is the fallback."""
    from mmserve.server.models import _quantization

    path = write_tiny_gguf(make_tiny_model(tmp_path, "llama"), "Q8_0")
    renamed = path.rename(path.with_name("my-q8_0-model.gguf"))
    assert _quantization(str(renamed), "") == "gguf:Q8_0"
    floats = write_tiny_gguf(make_tiny_model(tmp_path / "f", "llama"), "F16")
    assert _quantization(str(floats.rename(floats.with_name("model-Q4_0.gguf"))), "") == ""
