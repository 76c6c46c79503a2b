"""HF `architectures` name -> model implementation, imported only when asked for.

To add a model: write its module under mmserve/models/ and add one line to _MODELS.
"""

from __future__ import annotations

import importlib
from typing import Any

from mmserve.errors import UnsupportedModel
from mmserve.models.base import ModelBase

_LLAMA_CLS = ("mmserve.models.llama_classifier", "LlamaForSequenceClassification")
_QWEN2_VL = ("mmserve.models.qwen2_vl", "Qwen2VLForConditionalGeneration")  # 2 and 2.5
_LLAMA_EMBEDDING = ("mmserve.models.llama_embedding", "LlamaEmbeddingModel")  # no LM head
# architecture name (as in config.json "architectures") -> (module, class)
_MODELS: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("mmserve.models.llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("mmserve.models.llama", "LlamaForCausalLM"),
    "Qwen2ForCausalLM": ("mmserve.models.llama", "LlamaForCausalLM"),
    "Qwen3ForCausalLM": ("mmserve.models.llama", "LlamaForCausalLM"),
    "LlamaModel": _LLAMA_EMBEDDING,
    "MistralModel": _LLAMA_EMBEDDING,
    "Qwen2Model": _LLAMA_EMBEDDING,
    "Qwen3Model": _LLAMA_EMBEDDING,
    "LlamaForSequenceClassification": _LLAMA_CLS,
    "MistralForSequenceClassification": _LLAMA_CLS,
    "Qwen2ForSequenceClassification": _LLAMA_CLS,
    "Qwen3ForSequenceClassification": _LLAMA_CLS,
    "LlavaForConditionalGeneration": ("mmserve.models.llava", "LlavaForConditionalGeneration"),
    "CLIPModel": ("mmserve.models.clip", "CLIPModel"),
    "SiglipModel": ("mmserve.models.siglip", "SiglipModel"),
    "Qwen2VLForConditionalGeneration": _QWEN2_VL,
    "Qwen2_5_VLForConditionalGeneration": _QWEN2_VL,
    "BertModel": ("mmserve.models.bert", "BertModel"),
    "BertForSequenceClassification": ("mmserve.models.bert", "BertForSequenceClassification"),
    "XLMRobertaModel": ("mmserve.models.bert", "XLMRobertaModel"),
    "RobertaModel": ("mmserve.models.bert", "XLMRobertaModel"),  # same network as XLM-R
    "RobertaForSequenceClassification": (
        "mmserve.models.bert",
        "XLMRobertaForSequenceClassification",
    ),
    "XLMRobertaForSequenceClassification": (
        "mmserve.models.bert",
        "XLMRobertaForSequenceClassification",
    ),
}


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def architecture_of(hf_config: Any) -> str:
    """The config's first architecture. Configs read from GGUF carry none: those fall back to
    transformers' causal-LM class for the model_type."""
    architectures = getattr(hf_config, "architectures", None) or []
    if architectures:
        return str(architectures[0])
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    model_type = str(getattr(hf_config, "model_type", ""))
    architecture = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type)
    if architecture is None:
        raise UnsupportedModel(
            f"config names no architecture (model_type {model_type!r}); "
            f"supported: {supported_architectures()}"
        )
    return str(architecture)


def headless_architecture(architecture: str) -> str | None:
    """The bare-decoder architecture of a causal LM (Qwen3ForCausalLM -> Qwen3Model), when
    mmserve serves one: what a checkpoint naming the causal LM but holding no LM head is."""
    bare = architecture.removesuffix("ForCausalLM") + "Model"
    return bare if architecture.endswith("ForCausalLM") and bare in _MODELS else None


def get_model_class(architecture: str) -> type[ModelBase]:
    """The implementation class for an architecture; an unknown one lists the supported."""
    if architecture not in _MODELS:
        raise UnsupportedModel(
            f"architecture {architecture!r} is not supported; supported: {supported_architectures()}"
        )
    module, cls = _MODELS[architecture]
    model_class: type[ModelBase] = getattr(importlib.import_module(module), cls)
    return model_class
