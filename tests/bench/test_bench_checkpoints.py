"""`--checkpoint-format`: the random checkpoints load through mmserve as a user's would, with
the scheme the engine and ListModels report, and finite logits; a GGUF's tensors (read back
with the gguf package) are what the loader holds, in the types llama.cpp's Q4_K_M mix gives
them; a shape's checkpoint is written once, atomically, and reused."""

from __future__ import annotations

import json
import math
from pathlib import Path
from unittest import mock

import numpy as np
import pytest
import torch

from mmserve import LLM, SamplingParams
from mmserve.bench import checkpoints
from mmserve.bench.checkpoints import FORMATS, shape_checkpoint, write_checkpoint
from mmserve.bench.gguf_checkpoint import GgufWriter, tensor_type
from mmserve.kernels import cpu_lib
from mmserve.server.models import _quantization
from tests.utils.tiny_models import make_tiny_tokenizer, tiny_config

# the scheme as the engine runs it on the CPU (a GGUF keeps its blocks where the CPU kernels
# build, else is dequantised) and as ListModels names it (a GGUF's from its file name)
_KEPT = cpu_lib.available()
SCHEMES = {
    "w4a16-g128": ("w4a16-g128", "w4a16-g128"),
    "w4a16-g128-asym": ("w4a16-g128", "w4a16-g128"),
    "w8a16-g128": ("w8a16-g128", "w8a16-g128"),
    "w8a8-int8": ("w8a8-int8", "w8a8-int8"),
    "gguf:Q4_K_M": ("gguf:Q4_K+Q6_K" if _KEPT else "", "gguf:Q4_K_M"),
    "gguf:Q8_0": ("gguf:Q8_0" if _KEPT else "", "gguf:Q8_0"),
    "gguf:Q4_0": ("gguf:Q4_0+Q6_K" if _KEPT else "", "gguf:Q4_0"),
}


@pytest.fixture
def base(tmp_path: Path) -> Path:
    """A Llama config whose rows are whole K-quant blocks and g128 groups, with the tiny
    byte-level BPE tokenizer (the Llama 3 one takes a minute to read out of a GGUF)."""
    folder = tmp_path / "base"
    tiny_config(hidden_size=256, intermediate_size=512, head_dim=64).save_pretrained(folder)
    make_tiny_tokenizer().save_pretrained(folder)
    return folder


def test_every_format_is_listed() -> None:
    assert set(FORMATS) == set(SCHEMES)
    with pytest.raises(ValueError, match="choose one of w4a16-g128, w4a16-g128-asym"):
        checkpoints.checkpoint_writer("w3a16")


@pytest.mark.parametrize("fmt", list(SCHEMES))
def test_each_checkpoint_loads_with_its_scheme_and_finite_logits(
    base: Path, tmp_path: Path, fmt: str, one_thread: None
) -> None:
    path = write_checkpoint(base, fmt, tmp_path / "checkpoint", "tiny")
    llm = LLM(str(path), kv_cache_memory=8 << 20)
    engine_scheme, listed = SCHEMES[fmt]
    assert llm.frontend.info.quantization == engine_scheme
    assert _quantization(str(path), llm.frontend.info.quantization) == listed
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, prompt_logprobs=1)
    out = llm.generate(["Hello world, this is a test."], params, use_tqdm=False)[0]
    logprobs = [lp.logprob for lp in out.prompt_logprobs[1:]]  # type: ignore[index]
    assert logprobs and all(math.isfinite(x) for x in logprobs)
    # random weights: about uniform over the vocabulary, not one token certain
    assert all(-4 * math.log(384) < x < -0.25 * math.log(384) for x in logprobs)


@pytest.mark.skipif(not _KEPT, reason="the CPU GGUF kernels do not build here")
@pytest.mark.parametrize("fmt", ["gguf:Q4_K_M", "gguf:Q4_0", "gguf:Q8_0"])
def test_cpu_blocks_give_the_dequantised_models_logits(
    base: Path, tmp_path: Path, fmt: str, one_thread: None
) -> None:
    """The C library's products on every type of llama.cpp's mixes (Q4_K, Q6_K attn_v /
    ffn_down and an untied Q6_K head; Q4_0; Q8_0) give the logits of the same file
    dequantised at load: a prompt of several rows, then single-row decode steps."""
    from mmserve.attention.torch_ref import TorchAttentionBackend
    from mmserve.config import ModelConfig
    from mmserve.models import loader
    from mmserve.models.gguf_linear import gguf_quantization
    from tests.models.paged import PagedKV, PagedSeq

    config = ModelConfig(model=str(write_checkpoint(base, fmt, tmp_path / "checkpoint", "tiny")))
    kept, _, _ = loader.load_model(config, "cpu", "float32", TorchAttentionBackend())
    assert gguf_quantization(kept) == SCHEMES[fmt][0]
    with mock.patch.object(loader, "_keeps_gguf_blocks", return_value=False):
        floats, _, _ = loader.load_model(config, "cpu", "float32", TorchAttentionBackend())
    assert gguf_quantization(floats) == ""
    logits = []
    for model in (kept, floats):
        kv, seq = PagedKV(model, num_blocks=16), PagedSeq()
        steps = [kv.step(model, [(seq, [5, 17, 200, 3, 99, 41, 7])])]
        steps += [kv.step(model, [(seq, [token])]) for token in (12, 250, 64)]
        logits.append(torch.cat(steps))
    with torch.no_grad():
        torch.testing.assert_close(logits[0], logits[1], rtol=1e-4, atol=1e-4 * logits[1].abs().max().item())


def test_a_gguf_kept_as_blocks_reports_its_types(base: Path, tmp_path: Path, one_thread: None) -> None:
    """Blocks kept (forced, so also where the CPU kernels do not build and GgufLinear
    multiplies by the gguf package's dequantisation): the engine names the types it holds,
    most bytes first."""
    from mmserve.models import loader

    path = write_checkpoint(base, "gguf:Q4_K_M", tmp_path / "gguf", "tiny")
    with mock.patch.object(loader, "_keeps_gguf_blocks", return_value=True):
        llm = LLM(str(path), kv_cache_memory=8 << 20)
    assert llm.frontend.info.quantization == "gguf:Q4_K+Q6_K"
    assert _quantization(str(path), llm.frontend.info.quantization) == "gguf:Q4_K_M"
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True, prompt_logprobs=1)
    out = llm.generate(["Hello world"], params, use_tqdm=False)[0]
    assert all(math.isfinite(lp.logprob) for lp in out.prompt_logprobs[1:])  # type: ignore[index]


def test_compressed_tensors_tensors_are_llm_compressors(base: Path, tmp_path: Path) -> None:
    """pack-quantized with zero points: int32 packs of 8 values, bf16 scales per group of 128,
    the zero points packed along the output channels; int-quantized: int8 and [N, 1] scales."""
    from safetensors.torch import load_file

    asym = write_checkpoint(base, "w4a16-g128-asym", tmp_path / "asym", "tiny")
    config = json.loads((asym / "config.json").read_text())["quantization_config"]
    weights = config["config_groups"]["group_0"]["weights"]
    assert (config["format"], weights["num_bits"], weights["group_size"], weights["symmetric"]) == (
        "pack-quantized", 4, 128, False,
    )  # fmt: skip
    index = json.loads((asym / "model.safetensors.index.json").read_text())["weight_map"]
    tensors = {k: v for f in sorted(set(index.values())) for k, v in load_file(str(asym / f)).items()}
    q = "model.layers.1.self_attn.q_proj"
    assert tensors[f"{q}.weight_packed"].shape == (256, 256 // 8)
    assert tensors[f"{q}.weight_packed"].dtype == torch.int32
    assert tensors[f"{q}.weight_scale"].shape == (256, 2)
    assert tensors[f"{q}.weight_scale"].dtype == torch.bfloat16
    assert tensors[f"{q}.weight_zero_point"].shape == (256 // 8, 2)
    assert tensors[f"{q}.weight_shape"].tolist() == [256, 256]
    assert tensors["lm_head.weight"].dtype == torch.bfloat16  # (ignored: not quantised)
    assert len(tensors[f"{q}.weight_packed"].unique()) > 1000  # random, not a constant
    int8 = write_checkpoint(base, "w8a8-int8", tmp_path / "int8", "tiny")
    index = json.loads((int8 / "model.safetensors.index.json").read_text())["weight_map"]
    tensors = {k: v for f in sorted(set(index.values())) for k, v in load_file(str(int8 / f)).items()}
    down = "model.layers.0.mlp.down_proj"
    assert tensors[f"{down}.weight"].dtype == torch.int8 and tensors[f"{down}.weight"].shape == (256, 512)
    assert tensors[f"{down}.weight_scale"].shape == (256, 1)


def test_q4_k_m_gives_llama_cpps_types() -> None:
    """Llama-3-8B's Q4_K_M as llama.cpp writes it: Q6_K attn_v and ffn_down in the first and
    last four layers and every third between (16 of 32), Q6_K output, Q4_K elsewhere."""
    more_bits = {0, 1, 2, 3, 6, 9, 12, 15, 18, 21, 24, 27, 28, 29, 30, 31}
    for layer in range(32):
        want = "Q6_K" if layer in more_bits else "Q4_K"
        assert tensor_type("Q4_K_M", "attn_v", layer, 32) == want
        assert tensor_type("Q4_K_M", "ffn_down", layer, 32) == want
        assert tensor_type("Q4_K_M", "attn_q", layer, 32) == "Q4_K"
    assert tensor_type("Q4_K_M", "output", 0, 32) == "Q6_K"
    assert tensor_type("Q4_K_M", "token_embd", 0, 32) == "Q4_K"
    assert tensor_type("Q4_0", "output", 0, 32) == "Q6_K"
    assert tensor_type("Q8_0", "output", 0, 32) == "Q8_0"
    assert tensor_type("Q8_0", "attn_v", 0, 32) == "Q8_0"


def test_gguf_tensors_are_what_the_loader_holds(base: Path, tmp_path: Path) -> None:
    """Each tensor dequantised by the gguf package (q/k rows un-permuted by transformers'
    own GGUF code) equals the loaded model's weight; the 2-layer Q4_K_M mix holds Q6_K
    attn_v / ffn_down in layer 1 only (use_more_bits(1, 2)), and finite fp16 scales."""
    from gguf import GGUFReader
    from gguf.quants import dequantize
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    from mmserve.attention.torch_ref import TorchAttentionBackend
    from mmserve.config import ModelConfig
    from mmserve.models import loader

    path = write_checkpoint(base, "gguf:Q4_K_M", tmp_path / "gguf", "tiny")
    assert path == GgufWriter("Q4_K_M").model_path(tmp_path / "gguf", "tiny")
    reader = GGUFReader(path)
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    assert types["blk.0.attn_v.weight"] == types["blk.0.ffn_down.weight"] == "Q4_K"
    assert types["blk.1.attn_v.weight"] == types["blk.1.ffn_down.weight"] == "Q6_K"
    assert (types["output.weight"], types["token_embd.weight"], types["blk.1.attn_norm.weight"]) == (
        "Q6_K", "Q4_K", "F32",
    )  # fmt: skip
    with mock.patch.object(loader, "_keeps_gguf_blocks", return_value=False):  # (floats to compare)
        model, _, _ = loader.load_model(ModelConfig(model=str(path)), "cpu", "float32", TorchAttentionBackend())
    state = model.state_dict()
    heads, kv_heads = 4, 2
    for t in reader.tensors:
        weight = dequantize(t.data, t.tensor_type)
        spread = (0.0, 0.0) if t.tensor_type.name == "F32" else (0.001, 0.1)  # (norms: ones)
        assert np.isfinite(weight).all() and spread[0] <= float(weight.std()) <= spread[1], t.name
        if ".attn_q." in t.name or ".attn_k." in t.name:
            n = heads if ".attn_q." in t.name else kv_heads
            weight = LlamaTensorProcessor()._reverse_permute_weights(weight, n)
        ours = _loaded(state, t.name)
        assert torch.equal(ours, torch.from_numpy(np.array(weight)).view_as(ours)), t.name


def _loaded(state: dict[str, torch.Tensor], gguf_name: str) -> torch.Tensor:
    """The loaded model's rows that hold a GGUF tensor (q/k/v and gate/up are merged)."""
    q, kv, inter = 256, 128, 512
    simple = {"token_embd.weight": "model.embed_tokens.weight", "output.weight": "lm_head.weight",
              "output_norm.weight": "model.norm.weight"}  # fmt: skip
    if gguf_name in simple:
        return state[simple[gguf_name]]
    _, layer, kind, _ = gguf_name.split(".")
    p = f"model.layers.{layer}"
    rows = {
        "attn_norm": (f"{p}.input_layernorm.weight", None),
        "ffn_norm": (f"{p}.post_attention_layernorm.weight", None),
        "attn_q": (f"{p}.self_attn.qkv_proj.weight", slice(0, q)),
        "attn_k": (f"{p}.self_attn.qkv_proj.weight", slice(q, q + kv)),
        "attn_v": (f"{p}.self_attn.qkv_proj.weight", slice(q + kv, q + 2 * kv)),
        "attn_output": (f"{p}.self_attn.o_proj.weight", None),
        "ffn_gate": (f"{p}.mlp.gate_up_proj.weight", slice(0, inter)),
        "ffn_up": (f"{p}.mlp.gate_up_proj.weight", slice(inter, 2 * inter)),
        "ffn_down": (f"{p}.mlp.down_proj.weight", None),
    }
    name, part = rows[kind]
    return state[name] if part is None else state[name][part]


def test_a_shapes_checkpoint_is_written_once_and_atomically(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MMSERVE_CACHE_DIR", str(tmp_path / "cache"))
    root = tmp_path / "cache" / "bench-checkpoints"
    real = checkpoints.write_checkpoint

    def interrupted(*args: object, **kwargs: object) -> Path:
        raise KeyboardInterrupt

    monkeypatch.setattr(checkpoints, "write_checkpoint", interrupted)
    with pytest.raises(KeyboardInterrupt):
        shape_checkpoint("llama3-tiny", "w8a8-int8")
    assert list(root.iterdir()) == []  # nothing half-written is left to be found
    written: list[Path] = []

    def counted(base: Path, fmt: str, folder: Path, name: str, seed: int = 0) -> Path:
        written.append(folder)
        return real(base, fmt, folder, name, seed)

    monkeypatch.setattr(checkpoints, "write_checkpoint", counted)
    path = shape_checkpoint("llama3-tiny", "w8a8-int8")
    assert shape_checkpoint("llama3-tiny", "w8a8-int8") == path and len(written) == 1
    assert [p.name for p in root.iterdir()] == [path.name]  # (no staging folder left)
    config = json.loads((path / "config.json").read_text())
    assert (config["hidden_size"], config["quantization_config"]["format"]) == (256, "int-quantized")
    assert (path / "tokenizer.json").is_file()
    other = shape_checkpoint("llama3-tiny", "w4a16-g128")  # another format: its own folder
    assert other != path and len(written) == 2
