"""Random GGUF checkpoints of a Llama config, written with the gguf package's GGUFWriter as
llama.cpp's tools lay them out: llama metadata, the tokenizer as gpt2-style tokens and merges
(what transformers, and so mmserve's GGUF loader, builds a tokenizer from), F32 norms, and
each weight in the type llama.cpp's quantiser gives it for the file type.

Block bytes are random, with each block's fp16 scales (d, and dmin for Q4_K) set to finite
values that give weights of about the dummy load's spread. The tensors are declared first and
then written one at a time, so only one of them is ever in memory."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from mmserve.bench.random_weights import WEIGHT_STD, Draw, LlamaLayout

if TYPE_CHECKING:
    from gguf import GGUFWriter

# the spread of a block's weights when its bytes are random and its scales 1 (Q4_K: dmin 7.5,
# which centres them), measured with gguf.quants.dequantize; bytes at offset -> scale field
_SPREAD = {"Q4_0": 4.62, "Q8_0": 73.7, "Q3_K": 60.0, "Q4_K": 258.0, "Q6_K": 1368.0}
_SCALE_FIELDS = {"Q4_0": ((0, 1.0),), "Q8_0": ((0, 1.0),), "Q3_K": ((108, 1.0),),
                 "Q4_K": ((0, 1.0), (2, 7.5)), "Q6_K": ((208, 1.0),)}  # fmt: skip
# file type -> its base tensor type
FILE_TYPES = {"Q4_K_M": "Q4_K", "Q8_0": "Q8_0", "Q4_0": "Q4_0"}
_GGUF_NAMES = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output",
               "gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down"}  # fmt: skip


def use_more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's choice of the layers whose attn_v and ffn_down a _M mix keeps at more bits:
    the first and last eighth, and every third one between."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def tensor_type(file_type: str, kind: str, layer: int, layers: int) -> str:
    """The GGUF type of a weight (kind: token_embd, output, attn_q, ..., ffn_down) in a file of
    file_type, as llama.cpp's quantiser picks it (llama_tensor_get_type, dense models): the
    output Q6_K (Q8_0 in a Q8_0 file); in Q4_K_M, attn_v and ffn_down Q6_K in the layers
    use_more_bits names; everything else the file type's base type."""
    base = FILE_TYPES[file_type]
    if kind == "output":
        return "Q8_0" if base == "Q8_0" else "Q6_K"
    if file_type == "Q4_K_M" and kind in ("attn_v", "ffn_down") and use_more_bits(layer, layers):
        return "Q6_K"
    return base


@dataclass(frozen=True)
class _Tensor:
    name: str
    qtype: str  # a GGML type name; "F32" for norms
    rows: int
    cols: int  # elements per row (1 row of cols for a norm)


def _plan(layout: LlamaLayout, file_type: str) -> list[_Tensor]:
    h, n = layout.hidden, layout.layers
    tensors = [_Tensor("token_embd.weight", tensor_type(file_type, "token_embd", 0, n), layout.vocab, h)]
    for p in layout.projections():
        kind = _GGUF_NAMES[p.name]
        if kind == "attn_q":
            tensors.append(_Tensor(f"blk.{p.layer}.attn_norm.weight", "F32", 1, h))
        if kind == "ffn_gate":
            tensors.append(_Tensor(f"blk.{p.layer}.ffn_norm.weight", "F32", 1, h))
        qtype = tensor_type(file_type, kind, p.layer, n)
        tensors.append(_Tensor(f"blk.{p.layer}.{kind}.weight", qtype, p.out_features, p.in_features))
    tensors.append(_Tensor("output_norm.weight", "F32", 1, h))
    if not layout.tied:
        tensors.append(_Tensor("output.weight", tensor_type(file_type, "output", 0, n), layout.vocab, h))
    return tensors


def random_blocks(qtype: str, rows: int, cols: int, draw: Draw) -> np.ndarray:
    """uint8 [rows, row bytes]: random blocks of qtype with their scale fields set."""
    import gguf

    elements, block_bytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[qtype]]
    if cols % elements:
        raise ValueError(f"rows of {cols} are not whole {qtype} blocks of {elements}")
    blocks = draw.bytes((rows, cols // elements, block_bytes))
    d = WEIGHT_STD / _SPREAD[qtype]
    for offset, factor in _SCALE_FIELDS[qtype]:
        blocks[..., offset : offset + 2] = np.frombuffer(np.float16(d * factor).tobytes(), np.uint8)
    return blocks.reshape(rows, -1)


@dataclass(frozen=True)
class GgufWriter:
    """One .gguf file of a llama.cpp file type (Q4_K_M, Q8_0, Q4_0), named NAME-TYPE.gguf (the
    file name is where ListModels reads a GGUF's scheme)."""

    file_type: str
    pre_tokenizer: str = "llama-bpe"  # tokenizer.ggml.pre: the Llama 3 split

    def model_path(self, folder: Path, name: str) -> Path:
        return folder / f"{name}-{self.file_type}.gguf"

    def write(self, base: Path, folder: Path, name: str, draw: Draw) -> None:
        import gguf

        config = json.loads((base / "config.json").read_text())
        layout = LlamaLayout.of(config)
        plan = _plan(layout, self.file_type)
        folder.mkdir(parents=True, exist_ok=True)
        writer = gguf.GGUFWriter(str(self.model_path(folder, name)), "llama")
        _add_metadata(writer, config, layout, self.file_type)
        _add_tokenizer(writer, base / "tokenizer.json", config, layout.vocab, self.pre_tokenizer)
        for t in plan:
            if t.qtype == "F32":
                writer.add_tensor_info(t.name, (t.cols,), np.dtype(np.float32), 4 * t.cols)
            else:
                raw = gguf.GGMLQuantizationType[t.qtype]
                row_bytes = gguf.quant_shape_to_byte_shape((t.cols,), raw)[0]
                writer.add_tensor_info(t.name, (t.rows, row_bytes), np.dtype(np.uint8), t.rows * row_bytes, raw)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for data in _tensor_data(plan, draw):
            writer.write_tensor_data(data)
        writer.close()


def _tensor_data(plan: list[_Tensor], draw: Draw) -> Iterator[np.ndarray]:
    for t in plan:
        yield np.ones(t.cols, np.float32) if t.qtype == "F32" else random_blocks(t.qtype, t.rows, t.cols, draw)


def _add_metadata(writer: GGUFWriter, config: dict, layout: LlamaLayout, file_type: str) -> None:
    import gguf

    writer.add_name(f"random {config.get('model_type', 'llama')} {file_type}")
    writer.add_block_count(layout.layers)
    writer.add_context_length(config.get("max_position_embeddings", 8192))
    writer.add_embedding_length(layout.hidden)
    writer.add_feed_forward_length(layout.intermediate)
    writer.add_head_count(layout.heads)
    writer.add_head_count_kv(layout.kv_heads)
    writer.add_rope_dimension_count(layout.head_dim)
    writer.add_rope_freq_base(float(config.get("rope_theta", 10000.0)))
    writer.add_layer_norm_rms_eps(float(config.get("rms_norm_eps", 1e-5)))
    writer.add_vocab_size(layout.vocab)
    writer.add_file_type(gguf.LlamaFileType[f"MOSTLY_{file_type}"])
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)


def _add_tokenizer(writer: GGUFWriter, tokenizer_json: Path, config: dict, vocab: int, pre: str) -> None:
    """A byte-level BPE tokenizer.json as llama.cpp's converter writes it: every id up to the
    model's vocabulary a token (ids the tokenizer lacks padding, UNUSED), special added
    tokens CONTROL, other added tokens USER_DEFINED, the merges as "a b"."""
    from gguf import TokenType

    spec = json.loads(tokenizer_json.read_text())
    model = spec["model"]
    if model.get("type") != "BPE":
        raise ValueError(f"{tokenizer_json}: a byte-level BPE tokenizer is written to GGUF, not {model.get('type')}")
    added_tokens = spec.get("added_tokens", [])
    largest = max([*model["vocab"].values(), *(a["id"] for a in added_tokens)])
    if largest >= vocab:
        raise ValueError(f"{tokenizer_json}: token id {largest} is past the vocabulary ({vocab})")
    tokens = [f"[PAD{i}]" for i in range(vocab)]
    types = [TokenType.UNUSED] * vocab
    for token, index in model["vocab"].items():
        tokens[index], types[index] = token, TokenType.NORMAL
    for added in added_tokens:
        tokens[added["id"]] = added["content"]
        types[added["id"]] = TokenType.CONTROL if added.get("special") else TokenType.USER_DEFINED
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    for key, add in (("bos_token_id", writer.add_bos_token_id), ("eos_token_id", writer.add_eos_token_id)):
        if isinstance(config.get(key), int):
            add(config[key])
