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
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from mmserve import envs
from mmserve.models.source import ModelSource, iter_weights, load_hf_config

logger = logging.getLogger(__name__)
FORMAT_VERSION = "2"  # bump when the conversion changes (2: gguf_config_overrides)


def cache_dir() -> Path:
    """Where converted GGUF checkpoints live: under envs.cache_dir() (MMSERVE_CACHE_DIR)."""
    return envs.cache_dir() / "gguf"


def _key(gguf_path: Path) -> str:
    st = gguf_path.stat()
    ident = f"{FORMAT_VERSION}|{gguf_path.resolve()}|{st.st_size}|{st.st_mtime_ns}"
    return f"{gguf_path.stem}-{hashlib.sha256(ident.encode()).hexdigest()[:16]}"


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
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".tmp-"))
    try:
        with _one_metadata_parse():
            hf_config = load_hf_config(source)
            hf_config.save_pretrained(tmp)
            if weights:
                _save_weights(source, hf_config, tmp / "model.safetensors")
            load_tokenizer(source.folder, source.gguf_file).save_pretrained(tmp)
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
