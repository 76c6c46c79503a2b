"""The model contract of mmserve.models.base: every registered class declares its
ModelCapabilities, the flags say what the model does, every instance has every attribute of
the Protocols its flags select, and nothing probes a model with getattr/hasattr."""

from __future__ import annotations

import re
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any, Literal, cast

import pytest
import torch
import transformers
from torch import nn

from mmserve.attention.torch_ref import TorchAttentionBackend
from mmserve.errors import InvalidArgument
from mmserve.models import base
from mmserve.models.base import ImageTokenCount, ModelBase, ModelCapabilities
from mmserve.models.registry import get_model_class, supported_architectures
from tests.utils.tiny_models import TINY_VOCAB_SIZE, tiny_config
from tests.utils.tiny_qwen_vl import tiny_qwen2_vl_config

ROOT = Path(__file__).resolve().parents[2]
_VISION: dict[str, Any] = {
    "hidden_size": 48,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "image_size": 28,
    "patch_size": 7,
}
_TEXT: dict[str, Any] = {
    "vocab_size": TINY_VOCAB_SIZE,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "max_position_embeddings": 64,
}
_ENCODER = {**_TEXT, "num_attention_heads": 4, "hidden_act": "gelu", "pad_token_id": 1}

_DECODER = ModelCapabilities(supports_fp8=True, tensor_parallel=True)
_ENCODER_CAPS = ModelCapabilities(
    causal=False, uses_kv_cache=False, default_pooling="cls", tensor_parallel=True
)
_ENCODER_CLASSIFIER = ModelCapabilities(
    causal=False, uses_kv_cache=False, default_pooling="cls", classifier=True, tensor_parallel=True
)
_DUAL = ModelCapabilities(causal=False, uses_kv_cache=False, dual_encoder=True)
# what each class does, written down independently of its declaration
EXPECTED: dict[str, ModelCapabilities] = {
    "LlamaForCausalLM": _DECODER,
    "LlamaForSequenceClassification": ModelCapabilities(
        classifier=True, supports_fp8=True, tensor_parallel=True
    ),
    "LlavaForConditionalGeneration": ModelCapabilities(
        reads_images=True, supports_fp8=True, tensor_parallel=True
    ),
    "LlamaEmbeddingModel": ModelCapabilities(
        embeds_only=True, supports_fp8=True, tensor_parallel=True
    ),
    "Qwen2VLForConditionalGeneration": ModelCapabilities(
        reads_images=True, uses_mrope=True, supports_fp8=True, tensor_parallel=True
    ),
    "CLIPModel": _DUAL,
    "SiglipModel": _DUAL,
    "BertModel": _ENCODER_CAPS,
    "XLMRobertaModel": _ENCODER_CAPS,
    "BertForSequenceClassification": _ENCODER_CLASSIFIER,
    "XLMRobertaForSequenceClassification": _ENCODER_CLASSIFIER,
}


def _llava(vision: str = "clip", strategy: Literal["default", "full"] = "default") -> Any:
    tower = transformers.CLIPVisionConfig if vision == "clip" else transformers.SiglipVisionConfig
    return transformers.LlavaConfig(
        vision_config=tower(**_VISION),
        text_config=tiny_config("llama"),
        image_token_index=TINY_VOCAB_SIZE - 1,
        vision_feature_select_strategy=strategy,
        vision_feature_layer=-2,
    )


def _decoder_classifier(arch: str) -> Callable[[], Any]:
    return lambda: tiny_config(arch, num_labels=3)


def _encoder(config_class: Any, **extra: Any) -> Callable[[], Any]:
    return lambda: config_class(**_ENCODER, **extra)


# architecture -> a tiny transformers config of it
CONFIGS: dict[str, Callable[[], Any]] = {
    "LlamaForCausalLM": lambda: tiny_config("llama"),
    "MistralForCausalLM": lambda: tiny_config("mistral"),
    "Qwen2ForCausalLM": lambda: tiny_config("qwen2"),
    "Qwen3ForCausalLM": lambda: tiny_config("qwen3"),
    "LlamaModel": lambda: tiny_config("llama"),
    "MistralModel": lambda: tiny_config("mistral"),
    "Qwen2Model": lambda: tiny_config("qwen2"),
    "Qwen3Model": lambda: tiny_config("qwen3"),
    "LlamaForSequenceClassification": _decoder_classifier("llama"),
    "MistralForSequenceClassification": _decoder_classifier("mistral"),
    "Qwen2ForSequenceClassification": _decoder_classifier("qwen2"),
    "Qwen3ForSequenceClassification": _decoder_classifier("qwen3"),
    "LlavaForConditionalGeneration": _llava,
    "CLIPModel": lambda: transformers.CLIPConfig(
        text_config=_TEXT, vision_config=_VISION, projection_dim=24
    ),
    "SiglipModel": lambda: transformers.SiglipConfig(
        text_config={**_TEXT, "projection_size": 48}, vision_config=_VISION
    ),
    "Qwen2VLForConditionalGeneration": lambda: tiny_qwen2_vl_config("2"),
    "Qwen2_5_VLForConditionalGeneration": lambda: tiny_qwen2_vl_config("2.5"),
    "BertModel": _encoder(transformers.BertConfig),
    "BertForSequenceClassification": _encoder(transformers.BertConfig, num_labels=3),
    "XLMRobertaModel": _encoder(transformers.XLMRobertaConfig, type_vocab_size=1),
    "RobertaModel": _encoder(transformers.RobertaConfig, type_vocab_size=1),
    "RobertaForSequenceClassification": _encoder(
        transformers.RobertaConfig, type_vocab_size=1, num_labels=1
    ),
    "XLMRobertaForSequenceClassification": _encoder(
        transformers.XLMRobertaConfig, type_vocab_size=1, num_labels=1
    ),
}
# the optional part of the contract each flag selects
OPTIONAL: dict[str, type] = {
    "reads_images": base.MultiModalCausalLM,
    "uses_mrope": base.MRopeModel,
    "classifier": base.ClassifierModel,
    "dual_encoder": base.DualEncoderModel,
    "supports_fp8": base.Fp8Model,
}


def build(architecture: str) -> ModelBase:
    """The registered class built from a tiny config on the meta device (no weights)."""
    with torch.device("meta"):
        return get_model_class(architecture)(CONFIGS[architecture](), TorchAttentionBackend())


def protocol_members(protocol: type) -> set[str]:
    """Attributes and methods a Protocol (with its Protocol bases) declares."""
    names: set[str] = set()
    for cls in protocol.__mro__:
        if cls in (object, base.Protocol) or not getattr(cls, "_is_protocol", False):
            continue
        names |= set(vars(cls).get("__annotations__", {}))
        names |= {n for n, v in vars(cls).items() if callable(v) and not n.startswith("_")}
    return names


def test_every_architecture_has_a_tiny_config() -> None:
    assert sorted(CONFIGS) == supported_architectures()


@pytest.mark.parametrize("architecture", supported_architectures())
def test_each_class_declares_its_capabilities(architecture: str) -> None:
    cls = get_model_class(architecture)
    assert "capabilities" in vars(cls), f"{cls.__name__} inherits its capabilities silently"
    assert isinstance(cls.capabilities, ModelCapabilities)
    assert cls.capabilities == EXPECTED[cls.__name__]


@pytest.mark.parametrize("architecture", supported_architectures())
def test_instances_have_every_protocol_member(architecture: str) -> None:
    model = build(architecture)
    caps = model.capabilities
    wanted = protocol_members(base.CausalLM)
    for flag, protocol in OPTIONAL.items():
        if getattr(caps, flag):
            wanted |= protocol_members(protocol)
    missing = sorted(name for name in wanted if not hasattr(model, name))
    assert not missing, f"{type(model).__name__} lacks {missing}"
    assert isinstance(model.hidden_size, int) and isinstance(model.vocab_size, int)
    assert model.max_model_len is None or isinstance(model.max_model_len, int)
    assert isinstance(model.type_vocab_size, int) and model.type_vocab_size >= 1
    assert model.pad_text_to is None or model.pad_text_to > 0
    assert isinstance(model.sliding_windows, tuple)
    assert len(model.sliding_windows) in (0, model.num_layers)
    assert (model.image_token_id >= 0) == caps.reads_images


@pytest.mark.parametrize("architecture", supported_architectures())
def test_flags_match_what_the_model_does(architecture: str) -> None:
    model = build(architecture)
    caps = model.capabilities
    assert hasattr(model, "compute_class_logits") == caps.classifier
    assert hasattr(model, "encode_images") == caps.reads_images
    assert hasattr(model, "embed_images") == caps.dual_encoder
    assert hasattr(model, "mrope_positions") == caps.uses_mrope
    assert isinstance(model.image_tokens, ImageTokenCount) if caps.reads_images else True
    assert caps.uses_kv_cache or not caps.causal  # an encoder sees each input whole
    if caps.dual_encoder:
        assert model.num_layers == 0  # no KV cache layers
    if caps.supports_fp8:
        layers = cast(base.Fp8Model, model).decoder_layers()
        assert any(isinstance(m, nn.Linear) for m in layers.modules())


def _old_llava_count(model: Any, data: dict[str, torch.Tensor]) -> int:
    """LLaVA's num_image_tokens before ImageTokenCount (the reference)."""
    pixel_values = data["pixel_values"]
    size = model.vision_tower.image_size
    if tuple(pixel_values.shape[-3:]) != (3, size, size):
        raise InvalidArgument(
            "pixel_values", f"shape {tuple(pixel_values.shape)}; expected [1, 3, {size}, {size}]"
        )
    return model.vision_tower.num_tokens(size, size) - int(model.drop_first_row)


def _old_qwen_count(merge: int, data: dict[str, torch.Tensor]) -> int:
    """Qwen2-VL's num_image_tokens before ImageTokenCount (the reference)."""
    grid = data["image_grid_thw"]
    if grid.numel() != 3:
        raise InvalidArgument("image_grid_thw", f"shape {tuple(grid.shape)}, expected [1, 3]")
    t, h, w = (int(x) for x in grid.reshape(3).tolist())
    if h % merge or w % merge:
        raise InvalidArgument("image_grid_thw", f"{(t, h, w)}: h, w not multiples of merge")
    if data["pixel_values"].shape[0] != t * h * w:
        raise InvalidArgument("pixel_values", f"{data['pixel_values'].shape[0]} patches != t*h*w")
    return t * h * w // merge**2


Count = Callable[[dict[str, torch.Tensor]], int]


def _same_result(new: Count, old: Count, data: dict[str, torch.Tensor]) -> None:
    """Both give the same count, or both raise the same InvalidArgument."""
    try:
        expected = old(data)
    except InvalidArgument as e:
        with pytest.raises(InvalidArgument) as got:
            new(data)
        assert (got.value.field, str(got.value)) == (e.field, str(e))
        return
    assert new(data) == expected


@pytest.mark.parametrize("vision", ["clip", "siglip"])
@pytest.mark.parametrize("strategy", ["default", "full"])
def test_llava_image_tokens_match_the_old_count(
    vision: str, strategy: Literal["default", "full"]
) -> None:
    with torch.device("meta"):
        model: Any = get_model_class("LlavaForConditionalGeneration")(
            _llava(vision, strategy), TorchAttentionBackend()
        )
    counter = ImageTokenCount(**vars(model.image_tokens))  # a copy: plain data, no model
    for shape in [(1, 3, 28, 28), (1, 3, 28, 21), (1, 4, 28, 28), (3, 28, 28)]:
        data = {"pixel_values": torch.zeros(shape)}
        old = partial(_old_llava_count, model)
        _same_result(model.num_image_tokens, old, data)
        _same_result(counter.count, old, data)
    # 16 patches, CLIP's class token, less the first row under the "default" strategy
    assert model.image_tokens.per_image == 16 + (vision == "clip") - (strategy == "default")


@pytest.mark.parametrize("version", ["2", "2.5"])
def test_qwen2_vl_image_tokens_match_the_old_count(version: str) -> None:
    architecture = (
        "Qwen2VLForConditionalGeneration"
        if version == "2"
        else "Qwen2_5_VLForConditionalGeneration"
    )
    model: Any = build(architecture)
    merge = model.merge_size
    assert model.image_tokens == ImageTokenCount(merge_size=merge)
    cases = [((1, 4, 6), 24), ((2, 4, 4), 32), ((1, 3, 4), 12), ((1, 4, 4), 15), (None, 16)]
    for grid, patches in cases:
        thw = torch.tensor([[4, 4]]) if grid is None else torch.tensor([grid])
        data = {"pixel_values": torch.zeros(patches, 8), "image_grid_thw": thw}
        _same_result(model.num_image_tokens, partial(_old_qwen_count, merge), data)


_SCANNED = [
    *sorted((ROOT / "mmserve" / "runner").glob("*.py")),
    *sorted((ROOT / "mmserve" / "models").glob("*.py")),
    *sorted((ROOT / "mmserve" / "attention").glob("*.py")),
    *(
        ROOT / "mmserve" / "engine" / f
        for f in ("engine_core.py", "pooling_setup.py", "loading.py")
    ),
]
# a model (or its backend) probed for an attribute, or a capability name looked up by string
_PROBE = re.compile(
    r"\b(?:getattr|hasattr)\(\s*(?:self\.)?(?:model|backend|decoder|language_model)\b"
)
_CAPABILITY_NAMES = (
    "causal",
    "uses_kv_cache",
    "is_dual_encoder",
    "dual_encoder",
    "reads_images",
    "uses_mrope",
    "supports_fp8",
    "classifier",
    "default_pooling",
    "pad_text_to",
    "sliding_windows",
    "image_token_id",
    "image_tokens",
    "encode_images",
    "embed_images",
    "compute_class_logits",
    "num_labels",
    "forward_cached",
    "capabilities",
    "max_model_len",
)
_BY_NAME = re.compile(
    r"\b(?:getattr|hasattr)\(.*?[\"'](?:" + "|".join(_CAPABILITY_NAMES) + r")[\"']"
)


@pytest.mark.parametrize("path", _SCANNED, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_getattr_probing_of_models(path: Path) -> None:
    source = path.read_text()
    found = [
        f"{path.name}:{n}: {line.strip()}"
        for n, line in enumerate(source.splitlines(), 1)
        if _PROBE.search(line) or _BY_NAME.search(line)
    ]
    assert not found, "declare it (mmserve.models.base) instead of probing:\n" + "\n".join(found)


def test_a_declared_capability_without_its_methods_is_refused_at_load() -> None:
    """A model that declares reads_images (or uses_mrope, dual_encoder) must be the Protocol
    the flag names: the runner refuses it otherwise, before any request reaches a missing
    method."""
    from tests.fake_model import FakeModel

    class Claims(FakeModel):
        capabilities = ModelCapabilities(reads_images=True)  # no encode_images, image_tokens

    with pytest.raises(TypeError, match="Claims declares a MultiModalCausalLM"):
        base.check_capabilities(Claims())
    base.check_capabilities(FakeModel())  # declares nothing extra: fine
