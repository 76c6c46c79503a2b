"""Where converted GGUF checkpoints go: the cache folder of MMSERVE_CACHE_DIR, `~` expanded."""

from __future__ import annotations

from pathlib import Path

import pytest

from mmserve.models import gguf_cache
from mmserve.models.loader import ModelSource


def test_cache_dir_expands_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("MMSERVE_CACHE_DIR", "~/x")
    assert gguf_cache.cache_dir() == tmp_path / "x" / "gguf"
    monkeypatch.delenv("MMSERVE_CACHE_DIR")
    assert gguf_cache.cache_dir() == tmp_path / ".cache" / "mmserve" / "gguf"


def test_materialize_finds_the_conversion_under_the_expanded_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("MMSERVE_CACHE_DIR", "~/x")
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")  # only its path, size and mtime key the cache
    # a conversion already there (no real model converted): materialize must pick it up
    target = tmp_path / "home" / "x" / "gguf" / gguf_cache._key(gguf)
    target.mkdir(parents=True)
    (target / "model.safetensors").touch()
    assert gguf_cache.materialize(ModelSource(tmp_path, "m.gguf")) == ModelSource(target, None)
