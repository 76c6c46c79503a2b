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


def test_a_conversion_parses_the_metadata_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """transformers' load_gguf_checkpoint runs once per set of arguments inside a conversion
    (its config and tokenizer loaders both call it), each caller gets its own copy, and
    outside it is transformers' own again."""
    from transformers import modeling_gguf_pytorch_utils as gguf_utils

    calls: list[tuple] = []

    def parse(path, return_tensors=False):  # type: ignore[no-untyped-def]
        calls.append((path, return_tensors))
        return {"config": {"model_type": "llama", "layers": [1, 2]}}

    monkeypatch.setattr(gguf_utils, "load_gguf_checkpoint", parse)
    with gguf_cache._one_metadata_parse():
        first = gguf_utils.load_gguf_checkpoint("m.gguf", return_tensors=False)
        first["config"]["layers"].append(3)  # a caller's change stays its own
        second = gguf_utils.load_gguf_checkpoint("m.gguf", return_tensors=False)
        gguf_utils.load_gguf_checkpoint("other.gguf", return_tensors=False)
    assert second == {"config": {"model_type": "llama", "layers": [1, 2]}}
    assert calls == [("m.gguf", False), ("other.gguf", False)]
    assert gguf_utils.load_gguf_checkpoint is parse


def test_conversions_of_gone_or_changed_files_are_pruned(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A real conversion records its GGUF (SOURCE_FILE); the next conversion removes the
    folders whose GGUF is deleted or changed since, and old unfinished ones, keeping the rest
    and folders that predate the record."""
    import json
    import os
    import time

    from tests.utils.tiny_gguf import write_tiny_gguf
    from tests.utils.tiny_models import make_tiny_model

    monkeypatch.setenv("MMSERVE_CACHE_DIR", str(tmp_path / "cache"))
    base = make_tiny_model(tmp_path, "llama")
    kept, gone, changed = (write_tiny_gguf(base, name=name) for name in ("kept", "gone", "changed"))
    folders = {
        p: gguf_cache.materialize(ModelSource(p.parent, p.name), weights=False).folder for p in (kept, gone, changed)
    }
    recorded = json.loads((folders[kept] / gguf_cache.SOURCE_FILE).read_text())
    assert recorded["path"] == str(kept.resolve())
    legacy = gguf_cache.cache_dir() / "legacy-0123456789abcdef"  # converted before the record
    legacy.mkdir()
    unfinished = gguf_cache.cache_dir() / ".tmp-abandoned"
    unfinished.mkdir()
    os.utime(unfinished, (time.time() - 2 * 86400,) * 2)
    gone.unlink()
    changed.write_bytes(changed.read_bytes() + b"\0")
    fresh = write_tiny_gguf(base, name="fresh")
    gguf_cache.materialize(ModelSource(fresh.parent, fresh.name), weights=False)  # prunes first
    left = {p.name for p in gguf_cache.cache_dir().iterdir()}
    assert folders[kept].name in left and legacy.name in left
    assert folders[gone].name not in left and folders[changed].name not in left
    assert unfinished.name not in left and len(left) == 3
