"""`--checkpoint-format`: real quantised checkpoints of a benchmark shape, with random contents,
written once under the cache directory and then loaded as a user's checkpoint would be (load
format auto), so the benchmark measures the format's own load path and kernels.

    w4a16-g128        compressed-tensors pack-quantized, int4 symmetric, groups of 128, bf16 scales
    w4a16-g128-asym   the same with zero points
    w8a16-g128        int8 weight-only, groups of 128
    w8a8-int8         compressed-tensors int-quantized: int8 per channel, activations per token
    gguf:Q4_K_M       llama.cpp's Q4_K_M mix (Q4_K; Q6_K for output and some attn_v / ffn_down)
    gguf:Q8_0, gguf:Q4_0

A checkpoint is keyed by shape, format and the shape's config; it is written into a
temporary folder and renamed into place, so a half-written one is never found."""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
from pathlib import Path
from typing import Protocol

from mmserve import envs
from mmserve.bench.ct_checkpoint import CompressedTensorsWriter, IntQuantized, PackQuantized
from mmserve.bench.gguf_checkpoint import GgufWriter
from mmserve.bench.models import SHAPES, make_model_folder, model_folder
from mmserve.bench.random_weights import Draw

FORMAT_VERSION = "1"  # bump when a writer's output changes


class CheckpointWriter(Protocol):
    def model_path(self, folder: Path, name: str) -> Path:
        """What --model names once the checkpoint is in folder: the folder, or a file in it."""
        ...

    def write(self, base: Path, folder: Path, name: str, draw: Draw) -> None:
        """Writes the checkpoint of base's config.json (and tokenizer) into folder."""
        ...


FORMATS: dict[str, CheckpointWriter] = {
    "w4a16-g128": CompressedTensorsWriter(PackQuantized(4, 128, symmetric=True)),
    "w4a16-g128-asym": CompressedTensorsWriter(PackQuantized(4, 128, symmetric=False)),
    "w8a16-g128": CompressedTensorsWriter(PackQuantized(8, 128, symmetric=True)),
    "w8a8-int8": CompressedTensorsWriter(IntQuantized()),
    "gguf:Q4_K_M": GgufWriter("Q4_K_M"),
    "gguf:Q8_0": GgufWriter("Q8_0"),
    "gguf:Q4_0": GgufWriter("Q4_0"),
}


def checkpoint_writer(name: str) -> CheckpointWriter:
    if name not in FORMATS:
        raise ValueError(f"--checkpoint-format {name!r}: choose one of {', '.join(FORMATS)}")
    return FORMATS[name]


def write_checkpoint(base: Path, fmt: str, folder: Path, name: str, seed: int = 0) -> Path:
    """Writes a random checkpoint of base's config in fmt into folder; returns its model path."""
    writer = checkpoint_writer(fmt)
    draw = Draw(seed)
    try:
        writer.write(base, folder, name, draw)
    finally:
        draw.release()
    return writer.model_path(folder, name)


def model_path(
    model: str, load_format: str | None = None, checkpoint_format: str | None = None
) -> tuple[Path, bool]:
    """--model as a model path, and whether its weights are random: with a checkpoint format,
    shape:NAME's random checkpoint in it (loaded as it is); else bench.models.model_folder."""
    if checkpoint_format is None:
        return model_folder(model, load_format)
    if not model.startswith("shape:"):
        raise ValueError("--checkpoint-format writes a random checkpoint of a shape: give --model shape:NAME")
    if load_format == "dummy":
        raise ValueError("--checkpoint-format loads the checkpoint it writes: not with --load-format dummy")
    return shape_checkpoint(model.split(":", 1)[1], checkpoint_format), False


def shape_checkpoint(shape: str, fmt: str) -> Path:
    """The model path of shape's random checkpoint in fmt, written on first use."""
    writer = checkpoint_writer(fmt)
    if shape not in SHAPES:
        raise ValueError(f"unknown benchmark shape {shape!r}; choose one of {sorted(SHAPES)}")
    ident = json.dumps([FORMAT_VERSION, fmt, SHAPES[shape]], sort_keys=True)
    slug = fmt.replace(":", "-")
    root = envs.cache_dir() / "bench-checkpoints"
    target = root / f"{shape}-{slug}-{hashlib.sha256(ident.encode()).hexdigest()[:12]}"
    if target.is_dir():
        return writer.model_path(target, shape)
    root.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=root, prefix=".tmp-"))
    try:
        base = make_model_folder(shape, staging / "base")
        write_checkpoint(base, fmt, staging / "checkpoint", shape)
        try:
            (staging / "checkpoint").rename(target)  # atomic: a concurrent writer wins or finds it
        except OSError:
            if not target.is_dir():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return writer.model_path(target, shape)
