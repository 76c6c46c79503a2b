"""FP8 (w8a8) quantisation against transformers running the same quantised arithmetic.

The reference is transformers' own model with each decoder projection's weight replaced by its
FP8-rounded value (per-output-channel scale) and its input rounded to FP8 per token by a
forward pre-hook: the operands our Fp8Linear multiplies, computed independently of it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from mmserve.attention.torch_ref import TorchAttentionBackend
from mmserve.config import ModelConfig
from mmserve.errors import InvalidArgument, UnsupportedModel
from mmserve.kernels.quant import FP8_DTYPE, FP8_MAX, per_token_quant_ref, quantize_weight_fp8
from mmserve.models.fp8 import Fp8Linear, fp8_linear_ref
from mmserve.models.loader import load_model
from tests.models.paged import PagedKV, PagedSeq
from tests.utils.tiny_models import make_tiny_model

PROMPT = [5, 17, 42, 99, 250, 7, 300, 12, 64, 128, 3, 77, 200, 31]
# measured 1.3e-6; the margin is for float32 sums in another order moving an activation across
# an FP8 rounding boundary (fixed seeds: it would show every run). Quantisation moves logits ~0.3
ATOL = 1e-3


def fake_quant_hf(path: Path) -> Any:
    """transformers' float32 model computing what FP8 w8a8 computes, by its own modules."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager"
    )
    return fake_quantise(hf.eval(), lambda name: ".layers." in name)


def fake_quantise(hf: Any, selected: Any) -> Any:
    """Each nn.Linear of hf whose name `selected` accepts gets its weight rounded to FP8 (per
    output channel) and its input rounded to FP8 per token by a forward pre-hook."""

    def quantise_input(_module: Any, args: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        x = args[0]
        q, scale = per_token_quant_ref(x.reshape(-1, x.shape[-1]))
        return ((q.float() * scale).view(x.shape),)

    with torch.no_grad():
        for name, module in hf.named_modules():
            if isinstance(module, torch.nn.Linear) and selected(name):
                q, scale = quantize_weight_fp8(module.weight)
                module.weight.copy_(q.float() * scale[:, None])
                module.register_forward_pre_hook(quantise_input)
    return hf


def load_ours(path: Path, quantization: str | None = "fp8") -> Any:
    config = ModelConfig(model=str(path), quantization=quantization)
    return load_model(config, "cpu", "float32", TorchAttentionBackend())[0]


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def tiny(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    arch, overrides = {"llama": ("llama", {}), "qwen2": ("qwen2", {})}[
        request.param
    ]  # qwen2: q/k/v biases
    return make_tiny_model(tmp_path_factory.mktemp(request.param), arch, **overrides)


@torch.no_grad()
def test_logits_match_transformers_with_the_same_fp8_arithmetic(tiny: Path) -> None:
    from transformers import AutoModelForCausalLM

    model = load_ours(tiny)
    logits = PagedKV(model).step(model, [(PagedSeq(), PROMPT)])
    expected = fake_quant_hf(tiny)(torch.tensor([PROMPT])).logits[0]
    torch.testing.assert_close(logits, expected, atol=ATOL, rtol=0)
    # and the quantisation is real: the unquantised model's logits are measurably elsewhere
    plain = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32).eval()
    assert (plain(torch.tensor([PROMPT])).logits[0] - logits).abs().max() > 50 * ATOL


@torch.no_grad()
def test_chunked_prefill_and_decode_match_the_full_forward(tiny: Path) -> None:
    model = load_ours(tiny)
    expected = PagedKV(model).step(model, [(PagedSeq(), PROMPT)])
    kv, seq = PagedKV(model, block_size=4), PagedSeq()
    chunks = [PROMPT[:5], PROMPT[5:11]] + [[t] for t in PROMPT[11:]]
    rows = torch.cat([kv.step(model, [(seq, chunk)]) for chunk in chunks])
    torch.testing.assert_close(
        rows, expected, atol=1e-5, rtol=0
    )  # per-token scales: no batch effect


def test_greedy_tokens_match_transformers_generate(tiny: Path) -> None:
    from mmserve.entrypoints.llm import LLM
    from mmserve.params import SamplingParams

    hf = fake_quant_hf(tiny)
    with torch.no_grad():
        out = hf.generate(
            torch.tensor([PROMPT]), max_new_tokens=16, do_sample=False, min_new_tokens=16
        )
    expected = out[0, len(PROMPT) :].tolist()
    llm = LLM(str(tiny), quantization="fp8", dtype="float32")
    got = llm.generate([PROMPT], SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
    assert got[0].outputs[0].token_ids == expected


def test_projections_are_fp8_and_the_rest_is_not(tiny: Path) -> None:
    model = load_ours(tiny)
    layer = model.model.layers[0]
    for proj in (
        layer.self_attn.qkv_proj,
        layer.self_attn.o_proj,
        layer.mlp.gate_up_proj,
        layer.mlp.down_proj,
    ):
        assert isinstance(proj, Fp8Linear) and proj.weight.dtype == FP8_DTYPE
    assert model.lm_head.weight.dtype == torch.float32
    assert model.model.embed_tokens.weight.dtype == torch.float32
    plain = load_ours(tiny, quantization=None)
    fp8_bytes = sum(p.numel() * p.element_size() for p in layer.parameters())
    plain_bytes = sum(p.numel() * p.element_size() for p in plain.model.layers[0].parameters())
    assert fp8_bytes < 0.3 * plain_bytes  # float32 -> 1 byte per weight, plus scales and norms


def test_weight_scales_are_per_output_channel() -> None:
    weight = torch.randn(32, 48) * torch.logspace(-3, 2, 32)[:, None]  # rows 5 decades apart
    q, scale = quantize_weight_fp8(weight)
    assert q.dtype == FP8_DTYPE and scale.shape == (32,)
    torch.testing.assert_close(q.float().abs().amax(1), torch.full((32,), FP8_MAX))
    # e4m3 keeps 3 mantissa bits: each element within half a step (1/16 relative) of its value
    err = (q.float() * scale[:, None] - weight).abs()
    assert (err <= weight.abs() / 16 + scale[:, None] * 2**-9).all()


def test_linear_reference_and_module_agree_with_explicit_dequantisation() -> None:
    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 32, bias=True)
    x = torch.randn(7, 64) * torch.logspace(-2, 1, 7)[:, None]  # rows at different scales
    fp8 = Fp8Linear.from_linear(linear)
    xq, xs = per_token_quant_ref(x)
    wq, ws = quantize_weight_fp8(linear.weight.data)
    expected = (xq.double() * xs.double()) @ (
        wq.double() * ws.double()[:, None]
    ).t() + linear.bias.double()
    torch.testing.assert_close(fp8(x).double(), expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(
        fp8_linear_ref(x, wq, ws, linear.bias).double(), expected, atol=1e-5, rtol=1e-5
    )
    # the quantisation error itself stays small against the unquantised product
    assert ((fp8(x) - linear(x)).norm() / linear(x).norm()).item() < 0.05
    assert fp8(x[:0]).shape == (0, 32)
    assert fp8(x.view(7, 1, 64)).shape == (7, 1, 32)


def test_an_unknown_method_is_refused_naming_the_field(tiny: Path) -> None:
    with pytest.raises(InvalidArgument, match="quantization"):
        load_ours(tiny, quantization="int3")


def test_an_encoder_cannot_be_quantised(tmp_path: Path) -> None:
    from tests.pooling.tiny_pooling_models import make_tiny_bert

    with pytest.raises(UnsupportedModel, match="fp8"):
        load_ours(make_tiny_bert(tmp_path / "bert"))


# --- FP8 checkpoints (compressed-tensors, as llm-compressor saves FP8 and FP8-dynamic models)

CALIBRATION = PROMPT[:6]  # static input scales from a shorter prompt: PROMPT's loudest rows clamp


def write_checkpoint(
    src: Path, out: Path, tensors: dict[str, torch.Tensor], quantization_config: dict | None = None
) -> None:
    """src's folder copied to out with tensors as its model.safetensors and, when given,
    quantization_config in its config.json."""
    import json
    import shutil

    from safetensors.torch import save_file

    shutil.copytree(src, out)
    save_file(tensors, str(out / "model.safetensors"))
    if quantization_config is not None:
        config = json.loads((out / "config.json").read_text())
        config["quantization_config"] = quantization_config
        (out / "config.json").write_text(json.dumps(config))


def edit_quantization_config(folder: Path, edit: Any) -> None:
    """edit(quantization_config) applied to folder's config.json in place."""
    import json

    path = folder / "config.json"
    config = json.loads(path.read_text())
    edit(config["quantization_config"])
    path.write_text(json.dumps(config))


def save_fp8_checkpoint(
    src: Path, out: Path, weights: str, static: bool
) -> dict[str, torch.Tensor]:
    """src's model in the compressed-tensors FP8 format under out: FP8 projection weights with
    per-channel float32 or per-tensor bfloat16 weight_scale, and (static) a bfloat16
    input_scale per projection calibrated on CALIBRATION. Returns the scales by module name."""
    from safetensors.torch import load_file

    tensors = load_file(str(src / "model.safetensors"))
    input_amax: dict[str, float] = {}
    if static:
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
        for name, module in hf.named_modules():
            if isinstance(module, torch.nn.Linear) and ".layers." in name:
                module.register_forward_pre_hook(
                    lambda _m, args, name=name: input_amax.__setitem__(
                        name, args[0].abs().max().item()
                    )
                )
        with torch.no_grad():
            hf(torch.tensor([CALIBRATION]))
    scales: dict[str, torch.Tensor] = {}
    for name in [n for n in tensors if ".layers." in n and n.endswith("proj.weight")]:
        module, w = name.removesuffix(".weight"), tensors[name].float()
        if weights == "channel":
            q, scale = quantize_weight_fp8(w)
            tensors[f"{module}.weight_scale"] = scale.view(-1, 1)
        else:
            scale = (w.abs().max() / FP8_MAX).to(torch.bfloat16).view(1)
            q = (w / scale.float()).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
            tensors[f"{module}.weight_scale"] = scale
        tensors[name] = q
        scales[module] = tensors[f"{module}.weight_scale"].float()
        if static:
            tensors[f"{module}.input_scale"] = torch.tensor([input_amax[module] / FP8_MAX]).to(
                torch.bfloat16
            )
            scales[f"{module}.input"] = tensors[f"{module}.input_scale"].float()
    activations = {
        "num_bits": 8,
        "type": "float",
        "symmetric": True,
        "strategy": "token",
        "dynamic": True,
    }
    if static:
        activations.update(strategy="tensor", dynamic=False)
    quantization_config = {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "quantization_status": "compressed",
        "ignore": ["lm_head"],
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {
                    "num_bits": 8,
                    "type": "float",
                    "symmetric": True,
                    "strategy": weights,
                    "dynamic": False,
                },
                "input_activations": activations,
            }
        },
    }
    write_checkpoint(src, out, tensors, quantization_config)
    return scales


def checkpoint_reference(
    src: Path, fp8: Path, scales: dict[str, torch.Tensor], static: bool
) -> Any:
    """transformers on src's config with the dequantised FP8 weights of the checkpoint at fp8,
    each projection's input rounded to FP8 (per token, or by its own static input_scale)."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(
        src, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    tensors = load_file(str(fp8 / "model.safetensors"))
    with torch.no_grad():
        for module_name, scale in scales.items():
            if module_name.endswith(".input"):
                continue
            module = hf.get_submodule(module_name)
            module.weight.copy_(tensors[f"{module_name}.weight"].float() * scale.view(-1, 1))
            static_scale = scales.get(f"{module_name}.input") if static else None

            def quantise_input(_m: Any, args: Any, static_scale: Any = static_scale) -> Any:
                x = args[0]
                q, s = per_token_quant_ref(x.reshape(-1, x.shape[-1]), static_scale=static_scale)
                return ((q.float() * s).view(x.shape),)

            module.register_forward_pre_hook(quantise_input)
    return hf


@pytest.mark.parametrize(
    ("arch", "weights", "static"),
    [("llama", "channel", False), ("qwen2", "tensor", True), ("llama", "channel", True)],
    ids=["fp8-dynamic-channel", "fp8-static-tensor-bias", "fp8-static-channel"],
)
@torch.no_grad()
def test_an_fp8_checkpoint_loads_as_it_is(
    tmp_path: Path, arch: str, weights: str, static: bool
) -> None:
    src = make_tiny_model(tmp_path, arch, name="model")
    scales = save_fp8_checkpoint(src, tmp_path / "model-fp8", weights, static)
    model = load_ours(tmp_path / "model-fp8", quantization=None)  # FP8 because the checkpoint is
    qkv = model.model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv, Fp8Linear) and (qkv.input_scale is not None) == static
    logits = PagedKV(model).step(model, [(PagedSeq(), PROMPT)])
    reference = checkpoint_reference(src, tmp_path / "model-fp8", scales, static)
    expected = reference(torch.tensor([PROMPT])).logits[0]
    torch.testing.assert_close(logits, expected, atol=ATOL, rtol=0)
    # quantising again at load changes nothing: the checkpoint's weights are used as they are
    again = load_ours(tmp_path / "model-fp8", quantization="fp8")
    torch.testing.assert_close(PagedKV(again).step(again, [(PagedSeq(), PROMPT)]), logits)


def test_engines_say_whether_their_weights_are_fp8(tmp_path: Path) -> None:
    from mmserve.entrypoints.llm import LLM

    src = make_tiny_model(tmp_path, "llama", name="model")
    save_fp8_checkpoint(src, tmp_path / "model-fp8", "channel", False)
    assert LLM(str(tmp_path / "model-fp8")).frontend.info.quantization == "fp8"  # the checkpoint's
    assert LLM(str(src), quantization="fp8").frontend.info.quantization == "fp8"  # quantised at load
    assert LLM(str(src)).frontend.info.quantization == ""


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"quant_method": "bitsandbytes"}, "quant_method 'bitsandbytes'"),  # (gptq: weight_only.py)
        ({"kv_cache_scheme": {"num_bits": 8}}, "kv_cache_scheme"),
        ({"ignore": ["lm_head", "model.layers.0.mlp.down_proj"]}, "ignore"),
        (
            {"weights": {"num_bits": 8, "type": "float", "strategy": "group", "group_size": 128}},
            "weights",
        ),
        ({"weights": {"num_bits": 4, "type": "int", "strategy": "channel"}}, "weights"),
        ({"input_activations": None}, "input_activations"),
        (
            {
                "input_activations": {
                    "num_bits": 8,
                    "type": "float",
                    "strategy": "token",
                    "dynamic": False,
                }
            },
            "input_activations",
        ),
    ],
)
def test_fp8_schemes_we_cannot_run_exactly_are_refused(
    tmp_path: Path, change: dict, message: str
) -> None:

    def apply(qc: dict) -> None:
        group = qc["config_groups"]["group_0"]
        for key, value in change.items():
            (group if key in ("weights", "input_activations") else qc)[key] = value

    src = make_tiny_model(tmp_path, "llama", name="model")
    save_fp8_checkpoint(src, tmp_path / "model-fp8", "channel", False)
    edit_quantization_config(tmp_path / "model-fp8", apply)
    with pytest.raises(UnsupportedModel, match=message):
        load_ours(tmp_path / "model-fp8", quantization=None)


# --- block-wise FP8 checkpoints (transformers' "fp8", as Qwen3-FP8 ships them), dequantised at load


def save_block_fp8_checkpoint(
    src: Path, out: Path, block: tuple[int, int]
) -> dict[str, torch.Tensor]:
    """src's model with each projection weight in FP8 and a float32 weight_scale_inv per block
    (block by block, in plain loops); returns the dequantised weights by name."""
    from safetensors.torch import load_file

    tensors = load_file(str(src / "model.safetensors"))
    dequantised = {}
    for name in [n for n in tensors if ".layers." in n and n.endswith("proj.weight")]:
        w = tensors[name].float()
        rows, cols = w.shape
        grid = (-(-rows // block[0]), -(-cols // block[1]))
        scale, q = torch.zeros(grid), torch.zeros(rows, cols, dtype=FP8_DTYPE)
        back = torch.zeros(rows, cols)
        for i in range(grid[0]):
            for j in range(grid[1]):
                r, c = (
                    slice(i * block[0], (i + 1) * block[0]),
                    slice(j * block[1], (j + 1) * block[1]),
                )
                scale[i, j] = w[r, c].abs().max() / FP8_MAX
                q[r, c] = (w[r, c] / scale[i, j]).to(FP8_DTYPE)
                back[r, c] = q[r, c].float() * scale[i, j]
        tensors[name], tensors[f"{name}_scale_inv"], dequantised[name] = q, scale, back
    quantization_config = {
        "quant_method": "fp8",
        "activation_scheme": "dynamic",
        "weight_block_size": list(block),
    }
    write_checkpoint(src, out, tensors, quantization_config)
    return dequantised


@torch.no_grad()
def test_a_block_fp8_checkpoint_loads_as_transformers_loads_it(tmp_path: Path) -> None:
    """transformers, with no GPU, dequantises such a checkpoint as it loads: the same logits."""
    from transformers import AutoModelForCausalLM

    src = make_tiny_model(tmp_path, "qwen3", name="model")
    save_block_fp8_checkpoint(src, tmp_path / "fp8", (32, 32))
    model = load_ours(tmp_path / "fp8", quantization=None)
    assert not any(p.dtype == FP8_DTYPE for p in model.parameters())  # dequantised
    logits = PagedKV(model).step(model, [(PagedSeq(), PROMPT)])
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "fp8", dtype=torch.float32).eval()
    expected = hf(torch.tensor([PROMPT])).logits[0]
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=0)
    plain = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    assert (plain(torch.tensor([PROMPT])).logits[0] - logits).abs().max() > 1e-2  # FP8 weights


@torch.no_grad()
def test_partial_blocks_and_requantising(tmp_path: Path) -> None:
    """Blocks that do not divide the weights (which transformers refuses) against weights
    dequantised block by block; with --quantization fp8 the projections become FP8 again."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    src = make_tiny_model(tmp_path, "llama", name="model")
    dequantised = save_block_fp8_checkpoint(src, tmp_path / "fp8", (48, 40))
    reference = tmp_path / "dequantised"
    write_checkpoint(src, reference, {**load_file(str(src / "model.safetensors")), **dequantised})
    expected = (
        AutoModelForCausalLM.from_pretrained(reference, dtype=torch.float32)
        .eval()(torch.tensor([PROMPT]))
        .logits[0]
    )
    model = load_ours(tmp_path / "fp8", quantization=None)
    torch.testing.assert_close(
        PagedKV(model).step(model, [(PagedSeq(), PROMPT)]), expected, atol=1e-4, rtol=0
    )
    requantised = load_ours(tmp_path / "fp8", quantization="fp8")
    assert isinstance(requantised.model.layers[0].mlp.down_proj, Fp8Linear)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"weight_block_size": [128]}, "weight_block_size"),
        ({"activation_scheme": "static"}, "activation_scheme"),
        (
            {"weight_block_size": [16, 16]},
            "shape \\(2, 4\\), expected \\(4, 8\\) for blocks of \\(16, 16\\)",
        ),
    ],
)
def test_block_fp8_checkpoints_we_cannot_read_are_refused(
    tmp_path: Path, change: dict, message: str
) -> None:
    src = make_tiny_model(tmp_path, "llama", name="model")
    save_block_fp8_checkpoint(src, tmp_path / "fp8", (32, 32))
    edit_quantization_config(tmp_path / "fp8", lambda qc: qc.update(change))
    with pytest.raises(UnsupportedModel, match=message):
        load_ours(tmp_path / "fp8", quantization=None)


def test_a_weight_without_its_scale_is_refused() -> None:
    from mmserve.models.fp8 import dequantize_blocks

    q = torch.zeros(4, 4, dtype=FP8_DTYPE)
    pairs = [
        ("a.weight", q),
        ("a.weight_scale_inv", torch.ones(1, 1)),
        ("b.weight", q),
        ("n.bias", torch.ones(4)),
    ]
    with pytest.raises(UnsupportedModel, match="b.weight"):
        list(dequantize_blocks(pairs, (4, 4)))
    scale_first = [
        ("a.weight_scale_inv", torch.full((1, 1), 2.0)),
        ("a.weight", torch.ones(4, 4).to(FP8_DTYPE)),
    ]
    ((name, w),) = list(dequantize_blocks(scale_first, (4, 4)))
    assert name == "a.weight" and torch.equal(w, torch.full((4, 4), 2.0))


@torch.no_grad()
def test_a_vlm_language_model_in_fp8_matches_transformers(tmp_path: Path) -> None:
    """LLaVA with --quantization fp8: its language model's projections in FP8, the image tower
    and projector as they were; logits of a prompt with an image against transformers with the
    same FP8 arithmetic in its language model."""
    from mmserve.models.fp8 import quantize_fp8
    from tests.models.test_llava import Setup
    from tests.utils.tiny_vlm import make_tiny_llava

    setup = Setup(make_tiny_llava(tmp_path, "clip"))
    assert quantize_fp8(setup.ours) == 2 * 4  # two layers of four projections
    assert not any(isinstance(m, Fp8Linear) for m in setup.ours.vision_tower.modules())
    fake_quantise(setup.hf, lambda name: "language_model" in name and ".layers." in name)
    pixels = setup.pixels([(40, 30)], seed=1)
    ids = setup.prompt_ids("What is this?", pixels)
    logits = PagedKV(setup.ours, num_blocks=64).step(
        setup.ours, [(PagedSeq(), ids)], setup.embeds([(ids, pixels)])
    )
    expected = setup.hf(torch.tensor([ids]), pixel_values=torch.cat(pixels)).logits[0]
    torch.testing.assert_close(logits, expected, atol=ATOL, rtol=0)


def test_a_qwen2_vl_quantises_its_language_model(tmp_path: Path) -> None:
    from tests.utils.tiny_qwen_vl import make_tiny_qwen2_vl

    model = load_ours(make_tiny_qwen2_vl(tmp_path), quantization="fp8")
    assert isinstance(model.language_model.model.layers[0].mlp.down_proj, Fp8Linear)
    assert not any(isinstance(m, Fp8Linear) for m in model.visual.modules())


def test_an_fp8_checkpoint_with_kv_cache_scales_loads_them(tmp_path: Path) -> None:
    """llm-compressor's kv_cache_scheme (FP8, one static scale per tensor): the checkpoint's
    k_scale / v_scale tensors reach each attention layer; another KV scheme is refused."""
    from safetensors.torch import load_file, save_file

    src = make_tiny_model(tmp_path, "llama", name="model")
    out = tmp_path / "model-fp8"
    save_fp8_checkpoint(src, out, "channel", False)
    tensors = load_file(str(out / "model.safetensors"))
    layers = {n.split(".layers.")[1].split(".")[0] for n in tensors if ".layers." in n}
    for i in layers:
        tensors[f"model.layers.{i}.self_attn.k_scale"] = torch.tensor(0.5)
        tensors[f"model.layers.{i}.self_attn.v_scale"] = torch.tensor(0.25)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    scheme = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True}
    edit_quantization_config(out, lambda qc: qc.update(kv_cache_scheme=scheme))
    model = load_ours(out, quantization=None)
    assert {m.kv_scales for m in model.modules() if hasattr(m, "kv_scales")} == {(0.5, 0.25)}
    edit_quantization_config(out, lambda qc: qc["kv_cache_scheme"].update(strategy="head"))
    with pytest.raises(UnsupportedModel, match="kv_cache_scheme .* FP8 with static per-tensor"):
        load_ours(out, quantization=None)
