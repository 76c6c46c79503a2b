"""Where a checkpoint lives and how to read it: its source (HF folder or GGUF), its config
and its weight stream. The bottom of model loading: fp8, gguf_cache and loader all read
checkpoints through it, and it imports none of them.

Weights are read lazily, one tensor at a time (safetensors safe_open or the gguf reader's
memory map), and never with torch.load or remote code.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mmserve.errors import InvalidArgument, UnsupportedModel
from mmserve.models.gguf import gguf_config_overrides, iter_gguf_weights
from mmserve.models.parallel import Shard

# (checkpoint name, full shape) -> the part this rank reads (None: all); a model's weight_shard
WeightShard = Callable[[str, tuple[int, ...]], Shard | None]


@dataclass(frozen=True)
class ModelSource:
    """Where a checkpoint lives."""

    folder: Path  # the HF folder, or the folder that holds the GGUF file
    gguf_file: str | None  # the GGUF file's name inside folder; None for a safetensors folder


def resolve_model_source(model: str | Path) -> ModelSource:
    """Classifies a ModelConfig.model path; a path that is none of the accepted forms raises
    InvalidArgument naming the field."""
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return ModelSource(path.parent, path.name)
    if not path.is_dir():
        raise InvalidArgument("model", f"{path} is neither a folder nor a .gguf file")
    if (path / "config.json").is_file():
        return ModelSource(path, None)
    ggufs = sorted(p.name for p in path.glob("*.gguf"))
    if len(ggufs) == 1:
        return ModelSource(path, ggufs[0])
    if ggufs:
        raise InvalidArgument("model", f"{path} holds several .gguf files, name one: {ggufs}")
    raise InvalidArgument("model", f"{path} has neither config.json nor a .gguf file")


def load_hf_config(source: ModelSource) -> Any:
    """The transformers config (PretrainedConfig), from config.json or from GGUF metadata (with
    what transformers' reader misses of it: mmserve.models.gguf.gguf_config_overrides)."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(
            str(source.folder),
            gguf_file=source.gguf_file,
            trust_remote_code=False,
            local_files_only=True,
        )
    except (ValueError, KeyError) as e:  # unknown model_type, custom code, malformed file
        raise UnsupportedModel(f"cannot read the config of {source.folder}: {e}") from e
    if source.gguf_file is not None:
        for key, value in gguf_config_overrides(source.folder / source.gguf_file, config).items():
            setattr(config, key, value)
    return config


def load_generation_config(source: ModelSource) -> Any | None:
    """The folder's generation_config.json as a transformers GenerationConfig, else None
    (callers then fall back to hf_config.eos_token_id)."""
    if not (source.folder / "generation_config.json").is_file():
        return None
    from transformers import GenerationConfig

    return GenerationConfig.from_pretrained(str(source.folder), local_files_only=True)


def iter_safetensors_weights(
    folder: Path, shard: WeightShard | None = None, only: Callable[[str], bool] | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yields (name, tensor) one at a time from model.safetensors or the indexed shards;
    with shard, only the part of each tensor it names is read from the file; with only, only
    the tensors whose names it accepts are read."""
    from safetensors import safe_open

    index = folder / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (folder / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        raise UnsupportedModel(
            f"{folder} has no model.safetensors(.index.json); other formats are not loaded"
        )
    for file in files:
        with safe_open(str(folder / file), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not iterable)
                if only is not None and not only(name):
                    continue
                part = None
                if shard is not None:
                    lazy = f.get_slice(name)
                    shape = tuple(lazy.get_shape())
                    part = shard(name, shape)
                yield name, f.get_tensor(name) if part is None else part.read(lazy, shape)


def safetensors_names(folder: Path) -> set[str] | None:
    """The tensor names of a safetensors checkpoint (the index's, else the file's header),
    reading no tensor; None when the folder has neither."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        return set(json.loads(index.read_text())["weight_map"])
    if not (folder / "model.safetensors").is_file():
        return None
    from safetensors import safe_open

    with safe_open(str(folder / "model.safetensors"), framework="pt", device="cpu") as f:
        return set(f.keys())


def iter_weights(
    source: ModelSource,
    hf_config: Any,
    shard: WeightShard | None = None,
    only: Callable[[str], bool] | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor) pairs of the checkpoint, whatever its format; with shard, each
    tensor's part for this rank (a safetensors file reads only those bytes; a GGUF file is
    dequantised tensor by tensor and cut, the engine converts it to safetensors first); with
    only, the tensors whose names it accepts (a safetensors file reads no others)."""
    if source.gguf_file is not None:
        weights = iter_gguf_weights(source.folder / source.gguf_file, hf_config)
        if only is not None:
            weights = ((name, tensor) for name, tensor in weights if only(name))
        return shard_weights(weights, shard)
    return iter_safetensors_weights(source.folder, shard, only)


def shard_weights(
    weights: Iterator[tuple[str, torch.Tensor]], shard: WeightShard | None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Each whole tensor cut to this rank's part (formats read whole: GGUF, block FP8)."""
    if shard is None:
        yield from weights
        return
    for name, tensor in weights:
        part = shard(name, tuple(tensor.shape))
        yield name, tensor if part is None else part.read(tensor, tuple(tensor.shape))
