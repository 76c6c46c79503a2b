"""Converts a GGUF checkpoint once into a Hugging Face folder (config, float32 safetensors,
tokenizer, chat template) under the cache directory, so later starts load in seconds.

Reading a GGUF parses its whole metadata in Python (the vocabulary and merges) and dequantises
every tensor; the converted folder holds exactly the dequantised weights, so a model loaded
from it is the same model. transformers parses the file's metadata once for the config and
again for the tokenizer (about 15 s each for a Llama 3 vocabulary on a 2-core CPU): during a
conversion its parse is kept and handed out as copies (_one_metadata_parse), and the tensors
are found by mmserve's own index (models/gguf_index.py), which skips the vocabulary.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from mmserve import envs
from mmserve.models.source import ModelSource, iter_weights, load_hf_config

logger = logging.getLogger(__name__)
FORMAT_VERSION = "2"  # bump when the conversion changes (2: gguf_config_overrides)
SOURCE_FILE = "source.json"  # in each converted folder: the GGUF it came from (prune_stale)


def cache_dir() -> Path:
    """Where converted GGUF checkpoints live: under envs.cache_dir() (MMSERVE_CACHE_DIR)."""
    return envs.cache_dir() / "gguf"


def _key(gguf_path: Path) -> str:
    src = _source(gguf_path)
    ident = f"{FORMAT_VERSION}|{src['path']}|{src['size']}|{src['mtime_ns']}"
    return f"{gguf_path.stem}-{hashlib.sha256(ident.encode()).hexdigest()[:16]}"


def _source(gguf_path: Path) -> dict[str, Any]:
    """The identity of a GGUF file a conversion stands for: its path, size and mtime."""
    st = gguf_path.stat()
    return {"path": str(gguf_path.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def prune_stale(root: Path | None = None) -> list[Path]:
    """Removes the converted folders under root (default cache_dir()) whose GGUF file is gone
    or changed since (its SOURCE_FILE no longer matches), and leftovers of conversions that
    never finished (.tmp-* a day old): without it every GGUF converted once, a temporary
    file or an older version of a file, kept its copy (a float32 checkpoint) forever. Folders
    without a SOURCE_FILE (written before it) are left alone. Returns those removed."""
    root = cache_dir() if root is None else root
    removed = []
    for entry in root.iterdir() if root.is_dir() else ():
        if entry.name.startswith(".tmp-"):
            stale = time.time() - entry.stat().st_mtime > 86400
        else:
            try:
                recorded = json.loads((entry / SOURCE_FILE).read_text())
            except (OSError, ValueError):
                continue
            path = Path(recorded.get("path", ""))
            try:
                stale = not path.is_file() or _source(path) != recorded
            except OSError:
                stale = True
        if stale:
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(entry)
    return removed


def materialize(source: ModelSource, weights: bool = True) -> ModelSource:
    """The HF-folder form of a GGUF source (converted on first use); other sources as given.
    weights=False: only the config and tokenizer need be there (a CUDA load that keeps the
    GGUF's blocks reads its tensors from the file itself)."""
    if source.gguf_file is None:
        return source
    gguf_path = source.folder / source.gguf_file
    target = cache_dir() / _key(gguf_path)
    if not (target / "config.json").is_file():
        _convert(source, target, weights)
    if weights and not (target / "model.safetensors").is_file():
        _write_weights(source, target)
    return ModelSource(target, None)


def _convert(source: ModelSource, target: Path, weights: bool) -> None:
    from mmserve.processors.tokenizer import load_tokenizer

    logger.info("converting %s to %s (once)", source.gguf_file, target)
    target.parent.mkdir(parents=True, exist_ok=True)
    for entry in prune_stale(target.parent):
        logger.info("removed %s: its GGUF file is gone or changed", entry.name)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".tmp-"))
    try:
        with _one_metadata_parse():
            hf_config = load_hf_config(source)
            hf_config.save_pretrained(tmp)
            if weights:
                _save_weights(source, hf_config, tmp / "model.safetensors")
            load_tokenizer(source.folder, source.gguf_file).save_pretrained(tmp)
        assert source.gguf_file is not None
        (tmp / SOURCE_FILE).write_text(json.dumps(_source(source.folder / source.gguf_file)))
        try:
            tmp.rename(target)  # atomic: a concurrent converter either wins or finds it done
        except OSError:
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


@contextlib.contextmanager
def _one_metadata_parse() -> Iterator[None]:
    """While inside, transformers' load_gguf_checkpoint (which its config and tokenizer loaders
    import when called) parses each file once for the same arguments and hands each caller a
    deep copy of the result, so no caller sees another's changes. Outside, it is transformers'
    own again."""
    from transformers import modeling_gguf_pytorch_utils as gguf_utils

    original = gguf_utils.load_gguf_checkpoint
    parsed: dict[tuple[str, str], Any] = {}

    def once(path: Any, *args: Any, **kwargs: Any) -> Any:
        key = (str(path), repr((args, sorted(kwargs.items()))))
        if key not in parsed:
            parsed[key] = original(path, *args, **kwargs)
        return copy.deepcopy(parsed[key])

    gguf_utils.load_gguf_checkpoint = once  # type: ignore[assignment]
    try:
        yield
    finally:
        gguf_utils.load_gguf_checkpoint = original


def _write_weights(source: ModelSource, target: Path) -> None:
    """The float weights into a folder converted without them (atomically, as _convert)."""
    logger.info("dequantising %s into %s (once)", source.gguf_file, target)
    fd, tmp = tempfile.mkstemp(dir=target, prefix=".tmp-", suffix=".safetensors")
    os.close(fd)
    try:
        _save_weights(source, load_hf_config(ModelSource(target, None)), Path(tmp))
        os.replace(tmp, target / "model.safetensors")
    finally:
        Path(tmp).unlink(missing_ok=True)


def _save_weights(source: ModelSource, hf_config: Any, path: Path) -> None:
    from safetensors.torch import save_file

    tensors = {name: t.contiguous() for name, t in iter_weights(source, hf_config)}
    save_file(tensors, str(path), metadata={"format": "pt"})
