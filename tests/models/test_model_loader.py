"""Checkpoint resolution, dtypes, configs and refusals of the model loader."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from mmserve.attention.torch_ref import TorchAttentionBackend
from mmserve.config import ModelConfig
from mmserve.errors import InvalidArgument, UnsupportedModel
from mmserve.models.loader import load_model, resolve_dtype, resolve_model_source
from tests.models.paged import PagedKV, PagedSeq
from tests.utils.tiny_models import make_tiny_model


def load(path: Path, dtype: str = "auto", **config: Any) -> tuple[Any, Any, Any]:
    return load_model(ModelConfig(model=str(path), **config), "cpu", dtype, TorchAttentionBackend())


def test_resolve_model_source(tmp_path: Path) -> None:
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text("{}")
    assert resolve_model_source(tmp_path / "hf").gguf_file is None
    (tmp_path / "one").mkdir()
    (tmp_path / "one" / "m.Q4_0.gguf").touch()
    assert resolve_model_source(tmp_path / "one").gguf_file == "m.Q4_0.gguf"
    source = resolve_model_source(str(tmp_path / "one" / "m.Q4_0.gguf"))
    assert (source.folder, source.gguf_file) == (tmp_path / "one", "m.Q4_0.gguf")
    (tmp_path / "one" / "other.gguf").touch()
    for bad in ("one", "missing", "hf/config.json"):
        with pytest.raises(InvalidArgument, match="model"):
            resolve_model_source(tmp_path / bad)


def test_resolve_dtype() -> None:
    assert resolve_dtype("auto", "cpu") == torch.float32
    assert resolve_dtype("auto", torch.device("cuda")) == torch.bfloat16
    assert resolve_dtype("float16", "cpu") == torch.float16
    with pytest.raises(InvalidArgument, match="dtype"):
        resolve_dtype("fp8", "cpu")


def test_load_returns_configs(tmp_path: Path) -> None:
    model, hf_config, generation = load(make_tiny_model(tmp_path, "qwen2"))
    assert hf_config.model_type == "qwen2"
    assert generation is not None and generation.eos_token_id == 2
    assert (model.num_layers, model.num_kv_heads, model.head_dim, model.vocab_size) == (
        2,
        2,
        16,
        384,
    )
    assert not any(p.requires_grad for p in model.parameters())


@torch.no_grad()
def test_bfloat16_load(tmp_path: Path) -> None:
    path = make_tiny_model(tmp_path, "llama")
    ref, _, _ = load(path)
    model, _, _ = load(path, "bfloat16")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    ids = [3, 14, 15, 92, 65, 35]
    logits = PagedKV(model).step(model, [(PagedSeq(), ids)])
    assert logits.dtype == torch.float32
    torch.testing.assert_close(
        logits, PagedKV(ref).step(ref, [(PagedSeq(), ids)]), atol=0.2, rtol=0.05
    )


def test_loads_on_two_threads_keep_their_own_dtype(tmp_path: Path) -> None:
    """torch's default dtype is one per process: a load on another thread (a tensor-parallel
    rank run as a thread, as tests/gpu/test_gpu_tp_one_card.py does) must not see this one's
    restore. The second thread asks while the first is inside; the first still sees its dtype
    (it saw float32 on CUDA's packed load before the turns were taken)."""
    import threading
    import time

    from mmserve.models.loader import _default_dtype

    inside, seen = threading.Event(), []

    def first() -> None:
        with _default_dtype(torch.bfloat16):
            inside.set()
            time.sleep(0.3)  # the second thread is asking by now
            seen.append(torch.get_default_dtype())

    def second() -> None:
        inside.wait(5)
        with _default_dtype(torch.float16):
            seen.append(torch.get_default_dtype())

    threads = [threading.Thread(target=f) for f in (first, second)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert seen == [torch.bfloat16, torch.float16]
    assert torch.get_default_dtype() == torch.float32
    path = make_tiny_model(tmp_path, "llama")
    models: dict[str, Any] = {}
    loaders = [
        threading.Thread(target=lambda d=d: models.__setitem__(d, load(path, d)[0]))
        for d in ("bfloat16", "float16", "bfloat16", "float32")
    ]
    for t in loaders:
        t.start()
    for t in loaders:
        t.join(60)
    assert {d: {p.dtype for p in m.parameters()} for d, m in models.items()} == {
        "bfloat16": {torch.bfloat16}, "float16": {torch.float16}, "float32": {torch.float32}
    }


def test_sliding_window_policy(tmp_path: Path) -> None:
    path = make_tiny_model(tmp_path, "mistral", sliding_window=4)
    with pytest.raises(UnsupportedModel, match="sliding window"):
        load(path, sliding_window_policy="refuse")
    with pytest.raises(InvalidArgument, match="sliding_window_policy"):
        load(path, sliding_window_policy="ignore")
    load(make_tiny_model(tmp_path, "mistral"), sliding_window_policy="refuse")  # no window: fine


def _rewrite_weights(path: Path, edit: Callable[[dict[str, torch.Tensor]], object]) -> None:
    tensors = load_file(path / "model.safetensors")
    edit(tensors)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})


def test_missing_and_unexpected_weights_are_refused(tmp_path: Path) -> None:
    missing = make_tiny_model(tmp_path, "llama")
    _rewrite_weights(missing, lambda t: t.pop("model.layers.1.self_attn.k_proj.weight"))
    with pytest.raises(UnsupportedModel, match="k_proj|qkv_proj"):
        load(missing)
    extra = make_tiny_model(tmp_path, "llama")
    _rewrite_weights(extra, lambda t: t.update({"model.layers.0.extra.weight": torch.ones(2)}))
    with pytest.raises(UnsupportedModel, match="unexpected weight"):
        load(extra)
    wrong = make_tiny_model(tmp_path, "llama")
    _rewrite_weights(wrong, lambda t: t.update({"model.norm.weight": torch.ones(3)}))
    with pytest.raises(UnsupportedModel, match="model.norm.weight"):
        load(wrong)


@pytest.mark.parametrize(
    "overrides",
    [
        {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}},
        {"hidden_act": "gelu"},
    ],
)
def test_configs_we_cannot_match_are_refused(tmp_path: Path, overrides: dict[str, Any]) -> None:
    with pytest.raises(UnsupportedModel):
        load(make_tiny_model(tmp_path, "llama", **overrides))


def test_non_safetensors_checkpoint_is_refused(tmp_path: Path) -> None:
    path = make_tiny_model(tmp_path, "llama")
    (path / "model.safetensors").rename(path / "pytorch_model.bin")
    with pytest.raises(UnsupportedModel, match="safetensors"):
        load(path)


def test_unknown_architecture_is_refused(tmp_path: Path) -> None:
    path = make_tiny_model(tmp_path, "llama")
    config = json.loads((path / "config.json").read_text())
    config["architectures"] = ["LlamaForTokenClassification"]
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModel, match="LlamaForTokenClassification.*Qwen3ForCausalLM"):
        load(path)
