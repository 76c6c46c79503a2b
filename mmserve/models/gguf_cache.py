"""Converts a GGUF checkpoint once into a Hugging Face folder (config, float32 safetensors,
tokenizer, chat template) under the cache directory, so later starts load in seconds.

Reading a GGUF parses its whole metadata in Python (the vocabulary and merges) several times
over (config, tokenizer, tensors) and dequantises every tensor; the converted folder holds
exactly the dequantised weights, so a model loaded from it is the same model.
"""

from __future__ import annotations

import hashlib
import logging
import shutil
import tempfile
from pathlib import Path

from mmserve import envs
from mmserve.models.source import ModelSource, iter_weights, load_hf_config

logger = logging.getLogger(__name__)
FORMAT_VERSION = "1"  # bump when the conversion changes


def cache_dir() -> Path:
    """Where converted GGUF checkpoints live: under envs.cache_dir() (MMSERVE_CACHE_DIR)."""
    return envs.cache_dir() / "gguf"


def _key(gguf_path: Path) -> str:
    st = gguf_path.stat()
    ident = f"{FORMAT_VERSION}|{gguf_path.resolve()}|{st.st_size}|{st.st_mtime_ns}"
    return f"{gguf_path.stem}-{hashlib.sha256(ident.encode()).hexdigest()[:16]}"


def materialize(source: ModelSource) -> ModelSource:
    """The HF-folder form of a GGUF source (converted on first use); other sources as given."""
    if source.gguf_file is None:
        return source
    gguf_path = source.folder / source.gguf_file
    target = cache_dir() / _key(gguf_path)
    if not (target / "model.safetensors").is_file():
        _convert(source, target)
    return ModelSource(target, None)


def _convert(source: ModelSource, target: Path) -> None:
    from safetensors.torch import save_file

    from mmserve.processors.tokenizer import load_tokenizer

    logger.info("converting %s to %s (once)", source.gguf_file, target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".tmp-"))
    try:
        hf_config = load_hf_config(source)
        hf_config.save_pretrained(tmp)
        tensors = {name: t.contiguous() for name, t in iter_weights(source, hf_config)}
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        del tensors
        load_tokenizer(source.folder, source.gguf_file).save_pretrained(tmp)
        try:
            tmp.rename(target)  # atomic: a concurrent converter either wins or finds it done
        except OSError:
            if not (target / "model.safetensors").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


