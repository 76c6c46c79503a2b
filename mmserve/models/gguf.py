"""Reads GGUF tensors with the `gguf` package, dequantised and renamed to HF names.

Follows transformers' own GGUF loading (modeling_gguf_pytorch_utils.load_gguf_checkpoint) so
both give the same weights: names map through gguf's TensorNameMap applied to the HF model's
parameter names, and q/k weights of "llama"-architecture files (Llama, Mistral) are un-permuted,
since llama.cpp's converter interleaves the two rotary halves of every head.
"""

from __future__ import annotations

from collections.abc import Collection, Container, Iterator
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import torch

from mmserve.errors import UnsupportedModel

_PERMUTED_ARCHS = ("llama",)  # files whose q/k rows llama.cpp permuted at conversion
FLOAT_TYPES = ("F32", "F16", "BF16")  # GGUF types that load as floats everywhere
_Rows = TypeVar("_Rows", torch.Tensor, np.ndarray)


def gguf_architecture(reader: Any) -> str:
    """The file's general.architecture, e.g. "llama", "qwen2" (reader: as _scalar's)."""
    arch = _scalar(reader, "general.architecture")
    if arch is None:
        raise KeyError("general.architecture")
    return str(arch)


def gguf_config_overrides(path: Path, hf_config: Any) -> dict[str, Any]:
    """What the file states that transformers' GGUF config reader leaves at the config class's
    default, as {config attribute: the file's value}: head_dim, from attention.key_length
    (convert_hf_to_gguf.py writes the HF config's head_dim there; transformers maps it for
    qwen3_moe but not qwen3, whose head_dim then stays Qwen3Config's 128), and sliding_window,
    from attention.sliding_window or none (a "llama" file named "mistral" becomes a
    MistralConfig with that class's 4096 window, which llama.cpp does not apply)."""
    from mmserve.models.gguf_index import read_index

    reader = read_index(path)
    arch = gguf_architecture(reader)
    overrides: dict[str, Any] = {}
    head_dim = _scalar(reader, f"{arch}.attention.key_length")
    if head_dim is not None and getattr(hf_config, "head_dim", None) != head_dim:
        overrides["head_dim"] = head_dim
    window = _scalar(reader, f"{arch}.attention.sliding_window")
    if hasattr(hf_config, "sliding_window") and hf_config.sliding_window != window:
        overrides["sliding_window"] = window
    rope_freqs = next((t.data for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    rope = dict(getattr(hf_config, "rope_parameters", None) or {})
    if rope_freqs is not None and rope.get("rope_type", "default") == "default":
        llama3 = llama3_rope(np.asarray(rope_freqs, np.float64), float(rope["rope_theta"]))
        if llama3 is not None:
            overrides["rope_parameters"] = {**rope, **llama3}
    return overrides


def llama3_rope(factors: np.ndarray, theta: float) -> dict[str, Any] | None:
    """The "llama3" rope_parameters that give llama.cpp's rope_freqs tensor (the divisor of each
    rotary pair's frequency: 1 at high frequencies, `factor` at low ones, smooth between), which
    is all a GGUF keeps of a Llama 3.1+ rope scaling; None when every divisor is 1. Between the
    plateaus the smoothing is linear in 1 / wavelength: two pairs there fix its band (fewer
    leave Llama 3's own band to try). Divisors of no llama3 scaling raise UnsupportedModel."""
    if np.allclose(factors, 1.0):
        return None
    factor = float(factors.max())
    inv_wavelen = theta ** (-np.arange(len(factors)) / len(factors)) / (2 * np.pi)
    smooth = (1 / factors - 1 / factor) / (1 - 1 / factor)  # 1: unscaled, 0: divided by factor
    band = (smooth > 1e-6) & (smooth < 1 - 1e-6)
    old_context, low, high = 8192, 1.0, 4.0
    if band.sum() >= 2:  # smooth = (old_context * x - low) / (high - low), x = 1 / wavelength
        slope, intercept = np.polyfit(inv_wavelen[band], smooth[band], 1)
        low = round(float(-intercept * old_context / slope), 4)
        high = round(low + old_context / float(slope), 4)
    rope = {"rope_type": "llama3", "factor": factor, "low_freq_factor": low,
            "high_freq_factor": high, "original_max_position_embeddings": old_context}  # fmt: skip
    if not np.allclose(_llama3_factors(rope, inv_wavelen), factors, rtol=1e-4):
        raise UnsupportedModel(
            f"GGUF tensor rope_freqs.weight {np.round(factors, 4).tolist()} is no llama3 rope scaling"
        )
    return rope


def _llama3_factors(rope: dict[str, Any], inv_wavelen: np.ndarray) -> np.ndarray:
    """llama.cpp's rope_freqs for rope (convert_hf_to_gguf.py, LlamaModel)."""
    low, high = rope["low_freq_factor"], rope["high_freq_factor"]
    smooth = (rope["original_max_position_embeddings"] * inv_wavelen - low) / (high - low)
    smoothed = 1 / ((1 - smooth) / rope["factor"] + smooth)
    return np.where(smooth >= 1, 1.0, np.where(smooth <= 0, rope["factor"], smoothed))


def _scalar(reader: Any, key: str) -> Any:
    """A metadata value, or None (reader: a GgufIndex, whose fields are values, or a
    GGUFReader, whose fields have contents())."""
    field = reader.fields.get(key)
    if field is None:
        return None
    return field.contents() if hasattr(field, "contents") else field


def gguf_to_hf_names(hf_config: Any, gguf_arch: str) -> dict[str, str]:
    """GGUF tensor name -> HF parameter name, for every parameter of transformers' model."""
    import gguf
    from transformers import AutoModelForCausalLM

    arch = {name: arch for arch, name in gguf.MODEL_ARCH_NAMES.items()}.get(gguf_arch)
    if arch is None:
        raise UnsupportedModel(f"GGUF architecture {gguf_arch!r} is unknown to the gguf package")
    name_map = gguf.get_tensor_name_map(arch, hf_config.num_hidden_layers)
    with torch.device("meta"):  # only the names are needed: no memory, no init
        hf_model = AutoModelForCausalLM.from_config(hf_config)
    mapping: dict[str, str] = {}
    for hf_name in hf_model.state_dict():
        stem, _, suffix = hf_name.rpartition(".")
        gguf_name = name_map.get_name(stem) if suffix in ("weight", "bias") else None
        if gguf_name is not None:
            mapping.setdefault(f"{gguf_name}.{suffix}", hf_name)
    return mapping


def unpermute_rotary(weight: _Rows, num_heads: int) -> _Rows:
    """Undoes llama.cpp's q/k permutation, which reorders each head's rows from two halves
    (rotary pairs i, i + D/2) to adjacent pairs (2i, 2i + 1). weight: [num_heads * D, ...], a
    torch tensor or a numpy array (of floats, or of a quantised tensor's rows of blocks)."""
    half = weight.shape[0] // num_heads // 2
    grouped = weight.reshape(num_heads, half, 2, *weight.shape[1:])
    return grouped.swapaxes(1, 2).reshape(weight.shape)


def iter_gguf_weights(path: Path, hf_config: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """Yields (HF name, float32 tensor) one at a time; tensors with no HF counterpart (e.g.
    rope_freqs) are skipped, as transformers skips them."""
    from gguf.quants import dequantize

    for hf_name, _, qtype, data in _iter_named(path, hf_config):
        yield hf_name, _as_torch(dequantize(data, qtype))  # float32, HF shape [out, in]


def gguf_file_type(path: Path) -> str | None:
    """The scheme general.file_type names ("Q4_K_M", "Q8_0"; "F32", "F16", "BF16" for float
    files), or None when the file states none (or one this gguf package does not know)."""
    import gguf

    from mmserve.models.gguf_index import read_index

    value = _scalar(read_index(path), "general.file_type")
    try:
        name = gguf.LlamaFileType(int(value)).name if value is not None else None
    except ValueError:
        return None
    return None if name is None else name.removeprefix("MOSTLY_").removeprefix("ALL_")


def unkept_types(path: Path, supported: Collection[str]) -> list[str]:
    """The quantised types of the file's matrices whose blocks cannot be kept, sorted: Q3_K,
    IQ4_XS..."""
    from mmserve.models.gguf_index import read_index

    found = {t.tensor_type.name for t in read_index(path).tensors if len(t.data.shape) == 2}
    return sorted(found - set(supported) - set(FLOAT_TYPES))


def iter_gguf_blocks(
    path: Path, hf_config: Any, float_names: Container[str], supported: Collection[str]
) -> Iterator[tuple[str, torch.Tensor]]:
    """As iter_gguf_weights, but a 2-D tensor of a supported quantised type that is not in
    float_names comes as its blocks, uint8 [rows, blocks per row, bytes per block] (rows
    un-permuted as the floats are). A tensor of another quantised type raises
    UnsupportedModel naming it and its type."""
    from gguf import GGML_QUANT_SIZES
    from gguf.quants import dequantize

    for hf_name, gguf_name, qtype, data in _iter_named(path, hf_config):
        if qtype.name in FLOAT_TYPES or hf_name in float_names or data.ndim != 2:
            yield hf_name, _as_torch(dequantize(data, qtype))
        elif qtype.name in supported:
            # uint8 [rows, row bytes]: each row of the matrix is its row of blocks
            block_bytes = GGML_QUANT_SIZES[qtype][1]
            yield hf_name, _as_torch(data.reshape(data.shape[0], -1, block_bytes))
        else:
            raise UnsupportedModel(
                f"GGUF tensor {gguf_name} is {qtype.name}: its blocks cannot be kept; supported: "
                f"{', '.join([*supported, *FLOAT_TYPES])}"
            )


def _iter_named(path: Path, hf_config: Any) -> Iterator[tuple[str, str, Any, np.ndarray]]:
    """(HF name, GGUF name, GGMLQuantizationType, the data as stored: numpy, memory-mapped),
    with the q/k rows un-permuted where the file permuted them."""
    from mmserve.models.gguf_index import read_index

    reader = read_index(path)  # memory-maps the file; its vocabulary is skipped, not parsed
    arch = gguf_architecture(reader)
    names = gguf_to_hf_names(hf_config, arch)
    heads = {".attn_q.": hf_config.num_attention_heads, ".attn_k.": hf_config.num_key_value_heads}
    for tensor in reader.tensors:
        hf_name = names.get(tensor.name)
        if hf_name is None:
            continue
        data = tensor.data
        for marker, num_heads in heads.items():
            if arch in _PERMUTED_ARCHS and marker in tensor.name:
                data = unpermute_rotary(data, num_heads)  # whole rows: blocks move as floats do
        yield hf_name, tensor.name, tensor.tensor_type, data


def _as_torch(array: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(array if array.flags.writeable else np.array(array))
