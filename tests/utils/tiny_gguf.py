"""A tiny HF checkpoint (tests/utils/tiny_models.py) written as a GGUF file the way llama.cpp's
convert_hf_to_gguf.py writes one, for every architecture mmserve serves from GGUF.

    path = write_tiny_gguf(make_tiny_model(tmp_path, "qwen3"), "Q8_0")

What the converter does and this mirrors: Llama and Mistral are both arch "llama" (Mistral
has no arch of its own there) with the rows of q and k permuted per head (attn_k with the KV
heads' count), and llama's vocab_size and rope.dimension_count; Qwen2 and Qwen3 are their own
archs, unpermuted. Every arch gets TextModel's keys (context length, embedding and FFN
lengths, head counts, rope freq base, rms eps, and attention.key_length / value_length where
the HF config names head_dim), the tokenizer as gpt2 tokens and merges with its chat template,
1-D tensors (norms, biases) as F32, and output.weight only when the HF model has lm_head.weight
(tied embeddings write none); a llama3 rope scaling as the rope_freqs tensor, all the file
keeps of it. 2-D tensors are quantised to qtype with the gguf package (F32,
F16, Q8_0, Q4_0, ...); Q4_K, which it cannot quantise, is written as random blocks (with
output.weight Q6_K, as Q4_K_M has it), so only a GGUF reader can be the reference there.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np

ARCH_OF_MODEL_TYPE = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}
_PRE_TOKENIZER = {"llama": "llama-bpe", "qwen2": "qwen2", "qwen3": "qwen2"}
_RANDOM_TYPES = ("Q3_K", "Q4_K", "Q6_K")  # no quantiser in the gguf package


def write_tiny_gguf(base: Path, qtype: str = "F32", name: str | None = None, seed: int = 0) -> Path:
    """base (an HF folder with model.safetensors and tokenizer.json) as base/NAME-QTYPE.gguf."""
    import gguf
    from safetensors.numpy import load_file

    from mmserve.bench.gguf_checkpoint import _add_tokenizer

    config = json.loads((base / "config.json").read_text())
    arch = ARCH_OF_MODEL_TYPE[config["model_type"]]
    path = base / f"{name or base.name}-{qtype}.gguf"
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(name or f"Tiny {config['model_type']}")
    _add_hparams(writer, config, arch, qtype)
    _add_tokenizer(
        writer, base / "tokenizer.json", config, config["vocab_size"], _PRE_TOKENIZER[arch]
    )
    template = base / "chat_template.jinja"
    if template.is_file():
        writer.add_chat_template(template.read_text())
    name_map = gguf.get_tensor_name_map(_arch_enum(arch), config["num_hidden_layers"])
    rng = np.random.default_rng(seed)
    rope = config.get("rope_parameters") or {}
    if arch == "llama" and rope.get("rope_type") == "llama3":
        writer.add_tensor("rope_freqs.weight", llama3_rope_freqs(config))
    for hf_name, data in load_file(str(base / "model.safetensors")).items():
        stem, _, suffix = hf_name.rpartition(".")
        gguf_name = f"{name_map.get_name(stem)}.{suffix}"
        if (
            arch == "llama"
            and suffix == "weight"
            and (".attn_q." in gguf_name or ".attn_k." in gguf_name)
        ):
            heads = config["num_attention_heads"]
            data = _permute(
                data, heads if ".attn_q." in gguf_name else config["num_key_value_heads"]
            )
        _add_tensor(writer, gguf_name, data.astype(np.float32), qtype, rng)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def llama3_rope_freqs(config: dict) -> np.ndarray:
    """LlamaModel.generate_extra_tensors: a llama3 rope scaling as each rotary pair's divisor."""
    rope = config["rope_parameters"]
    dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    old_context = rope.get("original_max_position_embeddings", 8192)
    low, high, factor = (
        rope.get("low_freq_factor", 1.0),
        rope.get("high_freq_factor", 4.0),
        rope.get("factor", 8.0),
    )
    divisors = []
    for freq in 1.0 / (rope["rope_theta"] ** (np.arange(0, dim, 2, dtype=np.float32) / dim)):
        wavelen = 2 * math.pi / freq
        if wavelen < old_context / high:
            divisors.append(1.0)
        elif wavelen > old_context / low:
            divisors.append(factor)
        else:
            smooth = (old_context / wavelen - low) / (high - low)
            divisors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(divisors, np.float32)


def _arch_enum(arch: str) -> Any:
    import gguf

    return {name: enum for enum, name in gguf.MODEL_ARCH_NAMES.items()}[arch]


def _add_hparams(writer: Any, config: dict, arch: str, qtype: str) -> None:
    """TextModel.set_gguf_parameters, and LlamaModel's additions for arch "llama"."""
    import gguf

    heads = config["num_attention_heads"]
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(config.get("num_key_value_heads", heads))
    rope = config.get("rope_parameters") or {}
    writer.add_rope_freq_base(float(rope.get("rope_theta", config.get("rope_theta", 10000.0))))
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    if config.get("head_dim") is not None:
        writer.add_key_length(config["head_dim"])
        writer.add_value_length(config["head_dim"])
    file_type = {"F32": "ALL_F32", "F16": "MOSTLY_F16", "Q3_K": "MOSTLY_Q3_K_M", "Q4_K": "MOSTLY_Q4_K_M"}.get(
        qtype, f"MOSTLY_{qtype}"
    )
    writer.add_file_type(gguf.LlamaFileType[file_type])
    if arch == "llama":
        writer.add_vocab_size(config["vocab_size"])
        writer.add_rope_dimension_count(config.get("head_dim") or config["hidden_size"] // heads)


def _permute(weights: np.ndarray, n_head: int) -> np.ndarray:
    """LlamaModel.permute: each head's rotary halves interleaved into pairs."""
    return (
        weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


def _add_tensor(
    writer: Any, name: str, data: np.ndarray, qtype: str, rng: np.random.Generator
) -> None:
    import gguf
    from gguf.quants import quantize

    if data.ndim == 1 or qtype == "F32":
        writer.add_tensor(name, data)
        return
    if qtype in _RANDOM_TYPES:
        kind = "Q6_K" if name == "output.weight" else qtype
        blocks = _random_blocks(kind, data.shape[0], data.shape[1], data.std(), rng)
        writer.add_tensor(name, blocks, raw_dtype=gguf.GGMLQuantizationType[kind])
        return
    raw = gguf.GGMLQuantizationType[qtype]
    writer.add_tensor(name, quantize(data, raw), raw_dtype=raw)


def _random_blocks(
    qtype: str, rows: int, cols: int, std: float, rng: np.random.Generator
) -> np.ndarray:
    """Random blocks whose weights spread about as std (mmserve.bench.gguf_checkpoint's
    random_blocks, at the tiny model's scale rather than the benchmark's)."""
    import gguf

    from mmserve.bench.gguf_checkpoint import _SCALE_FIELDS, _SPREAD

    elements, block_bytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[qtype]]
    blocks = rng.integers(0, 256, (rows, cols // elements, block_bytes), dtype=np.uint8)
    for offset, factor in _SCALE_FIELDS[qtype]:
        scale = np.float16(std / _SPREAD[qtype] * factor)
        blocks[..., offset : offset + 2] = np.frombuffer(scale.tobytes(), np.uint8)
    return blocks.reshape(rows, -1)
