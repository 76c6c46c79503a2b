"""The architecture registry."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from transformers import PretrainedConfig

from mmserve.errors import UnsupportedModel
from mmserve.models.registry import architecture_of, get_model_class, supported_architectures

FAMILY = ["LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"]


def test_family_shares_one_implementation() -> None:
    classes = {get_model_class(name) for name in FAMILY}
    assert len(classes) == 1
    assert classes.pop().__module__ == "mmserve.models.llama"
    assert set(FAMILY) <= set(supported_architectures())


def test_unknown_architecture_lists_supported_ones() -> None:
    with pytest.raises(UnsupportedModel) as info:
        get_model_class("GPT2LMHeadModel")
    message = str(info.value)
    assert "GPT2LMHeadModel" in message
    assert all(name in message for name in FAMILY)


def test_architecture_from_config() -> None:
    assert (
        architecture_of(PretrainedConfig(architectures=["Qwen2ForCausalLM"])) == "Qwen2ForCausalLM"
    )
    # configs read from GGUF name no architecture: the model_type decides
    assert architecture_of(SimpleNamespace(model_type="llama")) == "LlamaForCausalLM"
    with pytest.raises(UnsupportedModel, match="no-such-type"):
        architecture_of(SimpleNamespace(model_type="no-such-type", architectures=None))
