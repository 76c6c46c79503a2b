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
    (target / "config.json").touch()
    (target / "model.safetensors").touch()
    assert gguf_cache.materialize(ModelSource(tmp_path, "m.gguf")) == ModelSource(target, None)


def test_the_float_weights_are_written_only_when_asked_for(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A CUDA load that keeps the GGUF's blocks needs only the config and tokenizer; a later
    CPU load of the same file adds the dequantised weights to that folder."""
    monkeypatch.setenv("MMSERVE_CACHE_DIR", str(tmp_path / "cache"))
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    target = gguf_cache.cache_dir() / gguf_cache._key(gguf)
    target.mkdir(parents=True)
    (target / "config.json").touch()  # converted without weights
    written: list[Path] = []
    monkeypatch.setattr(gguf_cache, "load_hf_config", lambda source: None)
    monkeypatch.setattr(
        gguf_cache, "_save_weights", lambda source, config, path: written.append(path) or path.touch()
    )
    source = ModelSource(tmp_path, "m.gguf")
    assert gguf_cache.materialize(source, weights=False) == ModelSource(target, None)
    assert written == [] and not (target / "model.safetensors").exists()
    assert gguf_cache.materialize(source) == ModelSource(target, None)
    assert len(written) == 1 and (target / "model.safetensors").is_file()
    assert sorted(p.name for p in target.iterdir()) == ["config.json", "model.safetensors"]
