"""Random compressed-tensors checkpoints as llm-compressor writes them: `pack-quantized`
weight-only int4 / int8 (w4a16, w8a16: groups of input channels, symmetric or with zero
points) and `int-quantized` INT8 w8a8 (int8 weights with one scale per output channel,
activations quantised per token when the model runs). The embedding, the norms and the LM head
stay bf16 (`ignore: ["lm_head"]`, as llm-compressor's recipes leave it).

Written as sharded safetensors (model-0000k-of-0000N.safetensors and the index), a shard at a
time, so the 8B shape never sits in memory whole."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from mmserve.bench.models import copy_model_files
from mmserve.bench.random_weights import WEIGHT_STD, Draw, LlamaLayout, Projection

SHARD_BYTES = 2 << 30


def _uniform_std(bits: int) -> float:
    """The spread of a uniformly drawn signed `bits`-bit integer."""
    return float((1 << bits) / 12**0.5)


@dataclass(frozen=True)
class PackQuantized:
    """compressed-tensors pack-quantized: weight_packed int32 [out, in * bits / 32] (value j of
    a row at bits (j % per) * bits of word j // per, stored + 2^(bits-1)), weight_scale bf16
    [out, groups], weight_shape [2], and with zero points weight_zero_point int32 [out * bits /
    32, groups] (packed along the output channels)."""

    bits: int  # 4 or 8
    group_size: int
    symmetric: bool

    def weights(self) -> dict:
        return {"num_bits": self.bits, "type": "int", "symmetric": self.symmetric, "strategy": "group",
                "group_size": self.group_size, "dynamic": False, "actorder": None,
                "observer": "minmax"}  # fmt: skip

    def quantization_config(self) -> dict:
        return _config("pack-quantized", {"weights": self.weights(), "input_activations": None})

    def projection(self, p: Projection, draw: Draw) -> dict[str, torch.Tensor]:
        if p.in_features % self.group_size:
            raise ValueError(f"{p.prefix}: {p.in_features} input channels are not groups of {self.group_size}")
        per, groups = 32 // self.bits, p.in_features // self.group_size
        # (q - z) spans about twice a value's range with zero points, once without
        scale = WEIGHT_STD / _uniform_std(self.bits) / (1 if self.symmetric else 2**0.5)
        tensors = {
            "weight_packed": draw.ints((p.out_features, p.in_features // per), torch.int32),
            "weight_scale": torch.full((p.out_features, groups), scale, dtype=torch.bfloat16),
            "weight_shape": torch.tensor([p.out_features, p.in_features]),
        }
        if not self.symmetric:
            words = -(-p.out_features // per)
            tensors["weight_zero_point"] = draw.ints((words, groups), torch.int32)
        return {f"{p.prefix}.{part}": t for part, t in tensors.items()}


@dataclass(frozen=True)
class IntQuantized:
    """compressed-tensors int-quantized INT8 w8a8: weight int8 [out, in], weight_scale bf16
    [out, 1]; activations int8 per token, dynamic (no input scales stored)."""

    def quantization_config(self) -> dict:
        args = {"num_bits": 8, "type": "int", "symmetric": True, "observer": "minmax"}
        group = {"weights": {**args, "strategy": "channel", "dynamic": False},
                 "input_activations": {**args, "strategy": "token", "dynamic": True}}  # fmt: skip
        return _config("int-quantized", group)

    def projection(self, p: Projection, draw: Draw) -> dict[str, torch.Tensor]:
        scale = WEIGHT_STD / _uniform_std(8)
        return {
            f"{p.prefix}.weight": draw.ints((p.out_features, p.in_features), torch.int8),
            f"{p.prefix}.weight_scale": torch.full((p.out_features, 1), scale, dtype=torch.bfloat16),
        }


def _config(form: str, group: dict) -> dict:
    return {
        "quant_method": "compressed-tensors",
        "format": form,
        "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear"], **group}},
        "ignore": ["lm_head"],
        "kv_cache_scheme": None,
    }


CompressedTensors = PackQuantized | IntQuantized


@dataclass(frozen=True)
class CompressedTensorsWriter:
    """A checkpoint folder: config.json with the quantization_config, the base folder's
    tokenizer files, the weights."""

    scheme: CompressedTensors

    def model_path(self, folder: Path, name: str) -> Path:
        return folder

    def write(self, base: Path, folder: Path, name: str, draw: Draw) -> None:
        config = json.loads((base / "config.json").read_text())
        layout = LlamaLayout.of(config)
        config.update(torch_dtype="bfloat16", quantization_config=self.scheme.quantization_config())
        folder.mkdir(parents=True, exist_ok=True)
        copy_model_files(base, folder)
        (folder / "config.json").write_text(json.dumps(config, indent=2))
        write_shards(folder, _tensors(layout, self.scheme, draw))


def _tensors(layout: LlamaLayout, scheme: CompressedTensors, draw: Draw) -> Iterator[dict[str, torch.Tensor]]:
    """The checkpoint in pieces: the embedding, each layer (norms and projections), the final
    norm and the head."""
    h = layout.hidden
    yield {"model.embed_tokens.weight": draw.normal((layout.vocab, h))}
    norms = layout.norms()
    layer: dict[str, torch.Tensor] = {}
    for p in layout.projections():
        if not layer:
            layer = {n: torch.ones(h, dtype=torch.bfloat16) for n in norms if f".layers.{p.layer}." in n}
        layer.update(scheme.projection(p, draw))
        if p.name == "down_proj":  # (the last of a layer)
            yield layer
            layer = {}
    yield {"model.norm.weight": torch.ones(h, dtype=torch.bfloat16)}
    if not layout.tied:
        yield {"lm_head.weight": draw.normal((layout.vocab, h))}


def write_shards(folder: Path, pieces: Iterator[dict[str, torch.Tensor]]) -> None:
    """Saves the pieces in shards of about SHARD_BYTES, named as transformers names them, with
    model.safetensors.index.json."""
    from safetensors.torch import save_file

    shards: list[list[str]] = []
    pending: dict[str, torch.Tensor] = {}

    def flush() -> None:
        save_file(pending, str(folder / f"shard-{len(shards)}.safetensors"), metadata={"format": "pt"})
        shards.append(list(pending))
        pending.clear()

    for piece in pieces:
        pending.update(piece)
        if sum(t.nbytes for t in pending.values()) >= SHARD_BYTES:
            flush()
    if pending:
        flush()
    weight_map: dict[str, str] = {}
    for k, names in enumerate(shards):
        final = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        (folder / f"shard-{k}.safetensors").rename(folder / final)
        weight_map.update(dict.fromkeys(names, final))
    index = {"metadata": {}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
