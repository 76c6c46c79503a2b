from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest

from mmserve.processors.tokenizer import (
    eos_token_ids,
    load_tokenizer,
    resolve_tokenizer_source,
    vocab_size,
)


def test_resolve_hf_folder(minilm_folder: Path) -> None:
    assert resolve_tokenizer_source(minilm_folder) == (minilm_folder, None)


def test_resolve_gguf_file_and_folder_with_one_gguf(tmp_path: Path) -> None:
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"")
    assert resolve_tokenizer_source(gguf) == (tmp_path, "m.gguf")
    assert resolve_tokenizer_source(tmp_path) == (tmp_path, "m.gguf")
    assert resolve_tokenizer_source(tmp_path, "other.gguf") == (tmp_path, "other.gguf")


def test_resolve_errors(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no such folder"):
        resolve_tokenizer_source(tmp_path / "missing")
    with pytest.raises(FileNotFoundError, match="found 0 .gguf"):
        resolve_tokenizer_source(tmp_path)
    (tmp_path / "a.gguf").write_bytes(b"")
    (tmp_path / "b.gguf").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match="found 2 .gguf"):
        resolve_tokenizer_source(tmp_path)
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(FileNotFoundError, match="expected a folder or a .gguf"):
        resolve_tokenizer_source(tmp_path / "notes.txt")


def test_smollm2_facts(smollm2_tokenizer: Any) -> None:
    # Values from MODELS.md.
    ids = smollm2_tokenizer("Hello world, this is a test.", add_special_tokens=False)["input_ids"]
    assert ids == [19556, 905, 28, 451, 314, 253, 1028, 30]
    assert smollm2_tokenizer.bos_token_id == 1
    assert eos_token_ids(smollm2_tokenizer) == (2,)
    assert vocab_size(smollm2_tokenizer) == 49152


def test_eos_ids_merge_generation_config(smollm2_tokenizer: Any) -> None:
    assert eos_token_ids(smollm2_tokenizer, 0) == (0, 2)
    assert eos_token_ids(smollm2_tokenizer, [2, 0, 7]) == (0, 2, 7)


def test_minilm_folder(minilm_tokenizer: Any) -> None:
    assert vocab_size(minilm_tokenizer) == 30522
    assert minilm_tokenizer("hello world")["input_ids"] == [101, 7592, 2088, 102]


def test_folder_without_tokenizer_json_uses_the_fast_tokenizer(
    minilm_folder: Path, tmp_path: Path
) -> None:
    # Only tokenizer_config.json + vocab.txt: transformers builds the Rust tokenizer itself.
    for name in ("tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
        shutil.copy(minilm_folder / name, tmp_path / name)
    tokenizer = load_tokenizer(tmp_path)
    assert tokenizer("hello world")["input_ids"] == [101, 7592, 2088, 102]


@pytest.mark.slow
def test_gguf_loads_like_the_cached_folder(smollm2_gguf: Path, smollm2_tokenizer: Any) -> None:
    from_gguf = load_tokenizer(smollm2_gguf.parent)  # the folder holding one .gguf
    text = "Grüße 😀 日本語 <|im_start|>user\nhi<|im_end|>"
    assert from_gguf(text)["input_ids"] == smollm2_tokenizer(text)["input_ids"]
    assert from_gguf.chat_template == smollm2_tokenizer.chat_template
    assert from_gguf.eos_token_id == smollm2_tokenizer.eos_token_id == 2
