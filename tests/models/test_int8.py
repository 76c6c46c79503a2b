"""INT8 w8a8 (`--quantization int8`): every decoder projection holds int8 weights with
per-channel scales and quantises its input per token; the logits and 16 greedy tokens are
those of transformers whose projections do the same arithmetic (a fake-quantised linear
written here from the scheme: absmax / 127 per row, round half to even, products summed
exactly), for a tiny Llama and a tiny Qwen2. ListModels says w8a8-int8."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mmserve import LLM, SamplingParams
from mmserve.errors import UnsupportedModel
from tests.entrypoints.test_llm_offline import hf_model
from tests.utils.tiny_models import make_tiny_model

PROMPT = "Paged attention stores keys and values in fixed-size blocks."


class FakeInt8(nn.Module):
    """transformers' nn.Linear, computing what an INT8 w8a8 GEMM computes."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        w = linear.weight.detach().double()
        self.w_scale = (w.abs().amax(1, keepdim=True) / 127).clamp(min=1e-12)
        self.w_q = torch.round(w / self.w_scale).clamp(-127, 127)
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xd = x.double()
        x_scale = (xd.abs().amax(-1, keepdim=True) / 127).clamp(min=1e-12)
        x_q = torch.round(xd / x_scale).clamp(-127, 127)
        out = (x_q @ self.w_q.t()) * x_scale * self.w_scale.t()
        out = out.to(x.dtype)
        return out if self.bias is None else out + self.bias


def fake_quantised(path: str) -> nn.Module:
    model = hf_model(path)
    for layer in model.model.layers:
        for parent in list(layer.modules()):
            for name, child in list(parent.named_children()):
                if isinstance(child, nn.Linear):
                    setattr(parent, name, FakeInt8(child))
    return model


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_int8_is_transformers_with_int8_projections(tmp_path, arch: str) -> None:  # type: ignore[no-untyped-def]
    path = str(make_tiny_model(tmp_path, arch))
    llm = LLM(path, quantization="int8", kv_cache_memory=8 << 20)
    assert llm.frontend.info.quantization == "w8a8-int8"
    ids = llm.tokenizer.encode(PROMPT)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, prompt_logprobs=1)
    out = llm.generate([PROMPT], params, use_tqdm=False)[0]
    reference = fake_quantised(path)
    with torch.no_grad():
        logprobs = torch.log_softmax(reference(torch.tensor([ids])).logits[0].float(), -1)
        want = reference.generate(torch.tensor([ids]), max_new_tokens=16, min_new_tokens=16,
                                  do_sample=False, pad_token_id=0)[0, len(ids):].tolist()  # fmt: skip
    assert out.outputs[0].token_ids == want
    got = [lp.logprob for lp in out.prompt_logprobs[1:]]  # type: ignore[index]
    assert got == pytest.approx([float(logprobs[i, t]) for i, t in enumerate(ids[1:])], abs=1e-4)
    plain = LLM(path, kv_cache_memory=8 << 20).generate([PROMPT], params, use_tqdm=False)[0]
    plain_lp = [lp.logprob for lp in plain.prompt_logprobs[1:]]  # type: ignore[index]
    assert max(abs(a - b) for a, b in zip(got, plain_lp, strict=True)) > 1e-4  # it is quantised


def test_int8_is_refused_where_it_does_not_apply() -> None:
    from mmserve.models.base import ModelCapabilities
    from mmserve.models.int8 import quantize_int8

    class Encoder(nn.Module):
        capabilities = ModelCapabilities(supports_fp8=False)

    with pytest.raises(UnsupportedModel, match="quantization int8 is supported for Llama-family"):
        quantize_int8(Encoder())  # type: ignore[arg-type]


def test_a_compressed_tensors_int8_checkpoint_loads_as_it_is(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """llm-compressor's W8A8 format (int-quantized: int8 weights with weight_scale [N, 1],
    activations int8 per token, dynamic): its int8 weights are the model's, and the outputs
    are those of the same arithmetic in transformers."""
    import json

    from safetensors.torch import load_file, save_file

    path = make_tiny_model(tmp_path, "llama")
    tensors = load_file(str(path / "model.safetensors"))
    projections = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    for name in [n for n in tensors if n.removesuffix(".weight").rsplit(".", 1)[-1] in projections]:
        w = tensors[name].double()
        scale = (w.abs().amax(1, keepdim=True) / 127).clamp(min=1e-12)
        tensors[name] = torch.round(w / scale).clamp(-127, 127).to(torch.int8)
        tensors[name.removesuffix("weight") + "weight_scale"] = scale.float()
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    args = {"num_bits": 8, "type": "int", "symmetric": True}
    config["quantization_config"] = {
        "quant_method": "compressed-tensors", "format": "int-quantized", "ignore": ["lm_head"],
        "config_groups": {"group_0": {"targets": ["Linear"],
                                      "weights": {**args, "strategy": "channel"},
                                      "input_activations": {**args, "strategy": "token", "dynamic": True}}},
    }  # fmt: skip
    (path / "config.json").write_text(json.dumps(config))
    llm = LLM(str(path), kv_cache_memory=8 << 20)
    assert llm.frontend.info.quantization == "w8a8-int8"
    model = llm.frontend.core.runner.model
    assert model.model.layers[0].self_attn.qkv_proj.weight.dtype == torch.int8
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    got = llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0].token_ids
    quantised_at_load = LLM(str(make_tiny_model(tmp_path, "llama")), quantization="int8", kv_cache_memory=8 << 20)
    assert got == quantised_at_load.generate([PROMPT], params, use_tqdm=False)[0].outputs[0].token_ids
    config["quantization_config"]["config_groups"]["group_0"]["input_activations"]["dynamic"] = False
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModel, match="input_activations .* int8 per token, dynamic"):
        LLM(str(path), kv_cache_memory=8 << 20)
