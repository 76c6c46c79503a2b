"""Fixtures of the speculative decoding tests."""

from __future__ import annotations

import pytest
import torch

from tests.utils.tiny_models import make_tiny_hf_model, make_tiny_tokenizer


@pytest.fixture(scope="session")
def peaked(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A tiny model whose next-token distributions are peaked (a few likely tokens each), so
    that a few thousand samples fill the chi-square cells."""
    out = tmp_path_factory.mktemp("peaked") / "tiny-peaked"
    model = make_tiny_hf_model("llama", seed=3)
    with torch.no_grad():
        model.lm_head.weight.mul_(3.0)
    model.save_pretrained(out)
    make_tiny_tokenizer().save_pretrained(out)
    return str(out)
