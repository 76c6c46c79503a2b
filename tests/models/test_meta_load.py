"""Loads that keep projections quantised (a weight-only checkpoint packed, a GGUF in its
blocks: the CUDA paths, forced here on the CPU, where WeightOnlyLinear runs under the Triton
interpreter and GgufLinear multiplies by the gguf package's dequantisation) build the model on
the meta device: every model class built so gets back the buffers it computes at
construction, the model loaded so is the one built in floats and packed after the load (every
parameter, buffer and logit), and no float tensor of a packed projection's shape is ever made
on the device."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from mmserve.attention.torch_ref import TorchAttentionBackend
from mmserve.config import ModelConfig
from mmserve.models import loader, weight_only
from mmserve.models.gguf import iter_gguf_blocks
from mmserve.models.gguf_linear import (
    SUPPORTED_TYPES,
    GgufEmbedding,
    GgufLinear,
    finish_gguf,
    prepare_gguf,
)
from mmserve.models.llama import LlamaForCausalLM
from mmserve.models.registry import get_model_class
from mmserve.models.source import ModelSource, iter_weights, load_hf_config
from mmserve.models.weight_only import (
    WeightOnlyLinear,
    checkpoint_weight_only,
    pack_weight_only,
    packed_parts,
)
from tests.models.paged import PagedKV, PagedSeq
from tests.models.test_capabilities import CONFIGS
from tests.utils.tiny_models import tiny_config

CPU = torch.device("cpu")
IDS = [5, 17, 33, 2, 90, 41, 7, 64]
# (format, bits, group size, symmetric, act order, arch) of tests.models.test_weight_only
WEIGHT_ONLY = [("gptq", 4, 16, False, True, "llama"), ("compressed-tensors", 4, 32, True, False, "qwen2")]
PACKED = (WeightOnlyLinear, GgufLinear, GgufEmbedding)


def _tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer by name (a tied one under each of its names)."""
    named = [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]
    return dict(named)


def assert_same_model(got: nn.Module, want: nn.Module) -> None:
    """The same modules, parameters and buffers (names, dtypes, devices, values; ties)."""
    assert [(n, type(m)) for n, m in got.named_modules()] == [(n, type(m)) for n, m in want.named_modules()]
    ours, theirs = _tensors(got), _tensors(want)
    assert list(ours) == list(theirs)
    for name, tensor in theirs.items():  # (NaN equal: a class may leave a parameter torch.empty)
        torch.testing.assert_close(ours[name], tensor, rtol=0, atol=0, equal_nan=True, msg=name)

    def ties(tensors: dict[str, torch.Tensor]) -> set[frozenset[str]]:
        groups: dict[int, set[str]] = {}
        for name, tensor in tensors.items():
            groups.setdefault(id(tensor), set()).add(name)
        return {frozenset(g) for g in groups.values() if len(g) > 1}

    assert ties(ours) == ties(theirs)


# every registered class, and a Llama whose LM head is its embedding
BUILDS: dict[str, tuple[str, Callable[[], Any]]] = {
    **{architecture: (architecture, config) for architecture, config in CONFIGS.items()},
    "tied Llama": ("LlamaForCausalLM", lambda: tiny_config("llama", tie_word_embeddings=True)),
}


@pytest.mark.parametrize("build", BUILDS)
def test_a_model_built_on_meta_gets_back_the_buffers_it_computes(build: str) -> None:
    """A model class built on the meta device then materialised has the buffers, parameter
    shapes and ties of the class built on the CPU (its parameters' values are the load's)."""
    architecture, make_config = BUILDS[build]
    cls, config = get_model_class(architecture), make_config()
    with CPU:
        want = cls(config, TorchAttentionBackend())
    with torch.device("meta"):
        got = cls(config, TorchAttentionBackend())
    with CPU:
        loader.materialize_meta(got, CPU)
    got.load_state_dict(want.state_dict())  # what a load fills (no computed buffer is in it)
    assert_same_model(got, want)


def test_a_buffer_no_module_recomputes_is_refused() -> None:
    class Computed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.empty(3))
            self.register_buffer("table", torch.arange(4.0), persistent=False)

    with torch.device("meta"):
        model = Computed()
    with pytest.raises(RuntimeError, match=r"\['table'\] hold no values after the meta build"):
        loader.materialize_meta(model, CPU)


def _packed_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(weight_only, "PACKED_ON", ("cuda", "cpu"))


def _load(path: Path | str, blocks: bool = False) -> Any:
    config = ModelConfig(model=str(path))
    with mock.patch.object(loader, "_keeps_gguf_blocks", return_value=blocks):
        return loader.load_model(config, "cpu", "float32", TorchAttentionBackend())[0]


def _weight_only_the_old_way(path: str) -> Any:
    """As the loader did before the meta build: the float model with the dequantised weights
    loaded (the CPU's load), then its projections packed from the checkpoint's parts."""
    with mock.patch.object(weight_only, "PACKED_ON", ("cuda",)):
        model = _load(path)
    source = ModelSource(Path(path), None)
    hf_config = load_hf_config(source)
    scheme = checkpoint_weight_only(hf_config)
    assert scheme is not None
    pack_weight_only(model, packed_parts(iter_weights(source, hf_config), scheme), scheme, torch.float32, CPU)
    model.weight_scheme = scheme.scheme
    return model


def _gguf_the_old_way(path: Path) -> Any:
    """As the loader did before the meta build: the float model built, its projections and
    embedding swapped for empty GGUF layers, the blocks loaded."""
    hf_config = load_hf_config(ModelSource(path.parent, path.name))
    with CPU:
        model = LlamaForCausalLM(hf_config, TorchAttentionBackend())
    prepare_gguf(model, CPU)
    float_names = {name for name, _ in model.named_parameters()}
    model.load_weights(iter_gguf_blocks(path, hf_config, float_names, SUPPORTED_TYPES))
    finish_gguf(model)
    return model.requires_grad_(False).eval()


def _logits(model: Any) -> torch.Tensor:
    with torch.no_grad():
        return PagedKV(model, num_blocks=8).step(model, [(PagedSeq(), IDS)])


def _gguf_checkpoint(tmp_path: Path) -> Path:
    from tests.utils.tiny_models import tiny_checkpoint

    return tiny_checkpoint(tmp_path, "gguf:Q4_K_M")


@pytest.mark.parametrize("case", WEIGHT_ONLY, ids=str)
def test_a_weight_only_checkpoint_loads_the_model_it_did(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, case: tuple
) -> None:
    from tests.models.test_weight_only import checkpoint

    _packed_on_cpu(monkeypatch)
    path, _ = checkpoint(tmp_path, *case)
    got, want = _load(path), _weight_only_the_old_way(path)
    assert sum(isinstance(m, WeightOnlyLinear) for m in got.modules()) == 4 * 2  # 2 layers
    assert_same_model(got, want)
    assert torch.equal(_logits(got), _logits(want))


def test_a_gguf_kept_in_blocks_loads_the_model_it_did(tmp_path: Path) -> None:
    path = _gguf_checkpoint(tmp_path)
    got, want = _load(path, blocks=True), _gguf_the_old_way(path)
    assert sum(isinstance(m, GgufLinear) for m in got.modules()) == 4 * 2 + 1  # and the head
    assert_same_model(got, want)
    assert torch.equal(_logits(got), _logits(want))


class _Made(TorchDispatchMode):
    """Records (shape, dtype, device) of every tensor an op returns."""

    def __init__(self) -> None:
        super().__init__()
        self.made: set[tuple[tuple[int, ...], torch.dtype, torch.device]] = set()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self.made.add((tuple(t.shape), t.dtype, t.device))
        return out


def _packed_shapes(model: nn.Module) -> set[tuple[int, ...]]:
    """The float shapes of the model's packed layers: [out, in], an embedding's [vocab, dim]."""
    shapes = set()
    for m in model.modules():
        if isinstance(m, GgufEmbedding):
            shapes.add((m.num_embeddings, m.embedding_dim))
        elif isinstance(m, (WeightOnlyLinear, GgufLinear)):
            shapes.add((m.out_features, m.in_features))
    return shapes


@pytest.mark.parametrize("kind", ["weight-only", "gguf"])
def test_the_load_makes_no_float_copy_of_a_packed_layer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    """Not one float tensor of a packed projection's full shape (or a GGUF embedding's) is
    made on the device while the model loads: the device's peak is the packed model's, not
    the float model's (about four times as much for 4-bit weights)."""
    if kind == "gguf":
        path: Path | str = _gguf_checkpoint(tmp_path)
    else:
        from tests.models.test_weight_only import checkpoint

        _packed_on_cpu(monkeypatch)
        path, _ = checkpoint(tmp_path, *WEIGHT_ONLY[0])
    with _Made() as made:
        model = _load(path, blocks=kind == "gguf")
    shapes = _packed_shapes(model)
    assert len(shapes) >= 4  # q/k/v, o, gate/up, down at least
    floats = {(s, d) for s, d, device in made.made if d.is_floating_point and device == CPU}
    assert not {(s, d) for s, d in floats if s in shapes}
    assert floats  # (the recorder saw the norms and the embedding load)
