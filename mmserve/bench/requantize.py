"""A weight-only compressed-tensors checkpoint (`pack-quantized`, as llm-compressor writes
W4A16 / W8A16) re-quantised from a model's float weights: what `mmserve bench quality` loads
for its wNa16 schemes.

Round to nearest, with the compressed-tensors library's own pieces: the scales of a min-max
observer (calculate_qparams, symmetric: absmax / 7.5 for int4), its packer
(PackedQuantizationCompressor.compress) and its quantization_config (ModelCompressor.
update_config). The decoder layers' projections are quantised; embeddings, norms and the LM
head stay float (llm-compressor's default recipes ignore lm_head). Scales keep the float
weights' dtype (float32 for a GGUF's dequantised weights).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from mmserve.bench.models import copy_model_files
from mmserve.models.gguf_cache import materialize
from mmserve.models.source import iter_weights, load_hf_config, resolve_model_source

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def weight_scheme(bits: int, group_size: int) -> Any:
    """The compressed-tensors QuantizationScheme: int weights of `bits`, symmetric, in
    groups of group_size input channels (0: one group per output channel)."""
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    strategy = {"strategy": "group", "group_size": group_size} if group_size else {"strategy": "channel"}
    args = QuantizationArgs(num_bits=bits, type="int", symmetric=True, **strategy)
    return QuantizationScheme(targets=["Linear"], weights=args)


def write_weight_only(model: str, folder: Path, bits: int, group_size: int) -> Path:
    """Writes model's weights re-quantised (see the module) into folder, with its config,
    tokenizer and generation config; returns folder. ValueError for a checkpoint that is
    quantised already, or a projection whose input size group_size does not divide."""
    from safetensors.torch import save_file

    source = materialize(resolve_model_source(model))  # a GGUF's float32 folder
    hf_config = load_hf_config(source)
    if getattr(hf_config, "quantization_config", None) is not None:
        raise ValueError(f"--model {model} is quantised already: wNa16 schemes need float weights")
    scheme = weight_scheme(bits, group_size)
    tensors: dict[str, torch.Tensor] = {}
    for name, tensor in iter_weights(source, hf_config):
        if is_projection(name):
            tensors.update(compress_projection(name, tensor, scheme))
        else:
            tensors[name] = tensor.contiguous()
    folder.mkdir(parents=True, exist_ok=True)
    copy_model_files(source.folder, folder, skip=())  # config.json too: its quantization_config is added
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    _write_quantization_config(folder, scheme)
    return folder


def is_projection(name: str) -> bool:
    """Whether a checkpoint tensor is a decoder layer's projection weight."""
    parts = name.split(".")
    return parts[-1] == "weight" and len(parts) > 2 and parts[-2] in PROJECTIONS and "layers" in parts


def compress_projection(name: str, weight: torch.Tensor, scheme: Any) -> dict[str, torch.Tensor]:
    """One projection's weight [out, in] -> its weight_packed, weight_scale and weight_shape
    (named after it), quantised to nearest under min-max scales."""
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization.utils import calculate_qparams

    prefix = name.removesuffix(".weight")
    in_features = weight.shape[1]
    size = scheme.weights.group_size or in_features
    if in_features % size:
        raise ValueError(
            f"{prefix}: {in_features} input channels are not a multiple of the group size {size}"
        )
    grouped = weight.unflatten(-1, (in_features // size, size))  # [out, groups, size]
    scale, zero = calculate_qparams(grouped.amin(-1), grouped.amax(-1), scheme.weights)
    state = {"weight": weight, "weight_scale": scale, "weight_zero_point": zero}
    packed = PackedQuantizationCompressor.compress(state, scheme)
    return {f"{prefix}.{part}": tensor.contiguous() for part, tensor in packed.items()}


def _write_quantization_config(folder: Path, scheme: Any) -> None:
    """config.json's quantization_config, as the library writes it for a compressed model."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig

    config = QuantizationConfig(
        config_groups={"group_0": scheme}, format="pack-quantized", ignore=["lm_head"],
        quantization_status="compressed",
    )  # fmt: skip
    ModelCompressor(quantization_config=config).update_config(str(folder))
