"""The reference for GGUF loads: transformers' own."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any
from unittest import mock

import torch


def transformers_from_gguf(folder: Path, gguf_file: str | None) -> Any:
    """transformers' GGUF load (None: the folder's own weights), float32, in eval mode. Within it the gguf package's reader and
    tensor-name map are made once (transformers makes the reader twice and the name map once
    per module: SmolLM2 28 s -> 13 s on 2 cores); the same read-only objects, the same weights."""
    import gguf
    from transformers import AutoModelForCausalLM

    with (
        mock.patch.object(gguf, "GGUFReader", functools.cache(gguf.GGUFReader)),
        mock.patch.object(gguf, "get_tensor_name_map", functools.cache(gguf.get_tensor_name_map)),
    ):
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf_file, dtype=torch.float32)
    return model.eval()
