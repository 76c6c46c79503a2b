"""models/quantized_input.py's FUSE_ACTIVATION_QUANT: with it on, the input norm, the
post-attention norm and the SiLU-and-mul hand qkv_proj, gate_up_proj and down_proj their
inputs quantised (o_proj quantises its own), and the logits are those with it off, bit for
bit: INT8, FP8, and an FP8 checkpoint's static input scales. On CPU the hand-over runs the torch
references (the kernels' bits are tests/kernels/test_fused_quant_kernels.py's and, on CUDA,
tests/gpu/test_gpu_fused_quant.py's)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from mmserve.models import quantized_input
from mmserve.models.quantized_input import QuantizedActivation, W8A8Linear
from tests.models.paged import PagedKV, PagedSeq
from tests.models.test_fp8 import PROMPT, load_ours, save_fp8_checkpoint
from tests.utils.tiny_models import make_tiny_model

FED = ("self_attn.qkv_proj", "mlp.gate_up_proj", "mlp.down_proj")  # fed quantised inputs


def load(path: Path, quantization: str | None, fuse: bool, monkeypatch: Any) -> Any:
    monkeypatch.setattr(quantized_input, "FUSE_ACTIVATION_QUANT", fuse)
    return load_ours(path, quantization)


@torch.no_grad()
def logits_and_inputs(model: Any) -> tuple[torch.Tensor, dict[str, set[type]]]:
    """A prefill then two decode steps' logits; and the types each projection was given."""
    seen: dict[str, set[type]] = {}
    for name, module in model.model.layers.named_modules():
        if isinstance(module, W8A8Linear):
            module.register_forward_pre_hook(
                lambda _m, args, name=name: seen.setdefault(name, set()).add(type(args[0]))
            )
    kv, seq = PagedKV(model), PagedSeq()
    chunks = [PROMPT[:-2], PROMPT[-2:-1], PROMPT[-1:]]
    return torch.cat([kv.step(model, [(seq, chunk)]) for chunk in chunks]), seen


@pytest.mark.parametrize("quantization", ["int8", "fp8"])
@pytest.mark.parametrize("arch", ["llama", "qwen3"])  # qwen3: its q/k norms feed no projection
def test_the_switch_changes_no_logit(tmp_path: Path, arch: str, quantization: str, monkeypatch: Any) -> None:  # fmt: skip
    path = make_tiny_model(tmp_path, arch)
    plain, plain_inputs = logits_and_inputs(load(path, quantization, False, monkeypatch))
    fused, fused_inputs = logits_and_inputs(load(path, quantization, True, monkeypatch))
    assert torch.equal(fused, plain)
    assert all(types == {torch.Tensor} for types in plain_inputs.values())
    for name, types in fused_inputs.items():  # 2 layers x 4 projections
        assert types == ({QuantizedActivation} if name.endswith(FED) else {torch.Tensor}), name
    assert len(fused_inputs) == 4 * len(load_ours(path, None).model.layers)


def test_a_static_input_scale_is_handed_over(tmp_path: Path, monkeypatch: Any) -> None:
    src = make_tiny_model(tmp_path, "llama", name="model")
    save_fp8_checkpoint(src, tmp_path / "fp8", "channel", static=True)
    plain, _ = logits_and_inputs(load(tmp_path / "fp8", None, False, monkeypatch))
    model = load(tmp_path / "fp8", None, True, monkeypatch)
    layer = model.model.layers[0]
    quant = layer.input_layernorm.output_quant
    assert quant is not None and quant.static_scale is layer.self_attn.qkv_proj.input_scale
    fused, seen = logits_and_inputs(model)
    assert torch.equal(fused, plain) and seen["0.self_attn.qkv_proj"] == {QuantizedActivation}


def test_nothing_is_handed_over_unquantised(tmp_path: Path, monkeypatch: Any) -> None:
    model = load(make_tiny_model(tmp_path, "llama"), None, True, monkeypatch)
    layer = model.model.layers[0]
    assert layer.input_layernorm.output_quant is None and layer.mlp.act_quant is None
