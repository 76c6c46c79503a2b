"""Tiny random CLIP, SigLIP and LLaVA checkpoints (fixed seeds) for tests: safetensors weights,
a tokenizer and the matching image processor's preprocessor_config.json in one folder.

    path = make_tiny_llava(tmp_path, vision="siglip", strategy="full", feature_layer=-1)
    processor = transformers.AutoImageProcessor.from_pretrained(path)  # offline, PIL backend

Images are 28x28 in 7x7 patches (16 patches). Weights are drawn at O(1) scale with non-trivial
norms and biases, so a wrong detail shows. The LLaVA tokenizer is the tiny ChatML one plus an
"<image>" special token (the config's image_token_id); its chat template renders a message's
content given as a string or as parts ({"type": "text", "text": ...} / {"type": "image"}).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import torch

from tests.utils.tiny_models import (
    TINY_VOCAB_SIZE,
    _free_folder,
    make_tiny_tokenizer,
    seed_weights,
    tiny_config,
)

IMAGE_SIZE = 28
PATCH_SIZE = 7
IMAGE_TOKEN = "<image>"
LLAVA_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<image>{% elif part['type'] == 'text' %}{{ part['text'] }}"
    "{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_VISION: dict[str, Any] = {  # shared by both tower kinds: 2 layers, hidden 48 in 4 heads
    "hidden_size": 48,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "image_size": IMAGE_SIZE,
    "patch_size": PATCH_SIZE,
}
_TEXT: dict[
    str, Any
] = {  # the dual encoders' text towers: hidden 32 in 2 heads (differs from the vision 48)
    "vocab_size": TINY_VOCAB_SIZE,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "max_position_embeddings": 64,
}


def make_tiny_clip(path: str | Path, *, seed: int = 0, eos_token_id: int | None = None) -> Path:
    """A CLIPModel folder (projection_dim 24). eos_token_id defaults to the tokenizer's (2:
    transformers' legacy pooling rule, argmax of the ids); any other id pools at its first
    occurrence."""
    import transformers

    tokenizer = make_tiny_tokenizer()
    eos = tokenizer.eos_token_id if eos_token_id is None else eos_token_id
    text = {**_TEXT, "eos_token_id": eos, "bos_token_id": tokenizer.bos_token_id, "pad_token_id": 0}
    config = transformers.CLIPConfig(
        text_config=text, vision_config={**_VISION, "hidden_act": "quick_gelu"}, projection_dim=24
    )
    processor = transformers.CLIPImageProcessor(
        size={"shortest_edge": IMAGE_SIZE}, crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}
    )
    return _save(path, "tiny-clip", transformers.CLIPModel(config), tokenizer, processor, seed)


def make_tiny_siglip(path: str | Path, *, seed: int = 0) -> Path:
    """A SiglipModel folder: text hidden 32 projected to the vision hidden 48."""
    import transformers

    tokenizer = make_tiny_tokenizer()
    text = {**_TEXT, "projection_size": _VISION["hidden_size"]}
    text.update(eos_token_id=tokenizer.eos_token_id, bos_token_id=1, pad_token_id=0)
    config = transformers.SiglipConfig(text_config=text, vision_config=_VISION)
    processor = transformers.SiglipImageProcessor(size={"height": IMAGE_SIZE, "width": IMAGE_SIZE})
    return _save(path, "tiny-siglip", transformers.SiglipModel(config), tokenizer, processor, seed)


def make_tiny_llava(
    path: str | Path,
    vision: str = "clip",
    *,
    strategy: Literal["default", "full"] = "default",
    feature_layer: int | list[int] = -2,
    seed: int = 0,
) -> Path:
    """A LlavaForConditionalGeneration folder: a tiny CLIP or SigLIP tower and the tiny Llama
    (tests.utils.tiny_models) decoder; strategy and feature_layer are the config's
    vision_feature_select_strategy and vision_feature_layer."""
    import transformers

    tokenizer = llava_tokenizer()
    image_token_id = tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
    if vision == "clip":
        vision_config: Any = transformers.CLIPVisionConfig(**_VISION)
        processor: Any = transformers.CLIPImageProcessor(
            size={"shortest_edge": IMAGE_SIZE},
            crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE},
        )
    elif vision == "siglip":
        vision_config = transformers.SiglipVisionConfig(**_VISION)
        processor = transformers.SiglipImageProcessor(
            size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}
        )
    else:
        raise ValueError(f"unknown tiny vision tower {vision!r}; choose clip or siglip")
    config = transformers.LlavaConfig(
        vision_config=vision_config,
        text_config=tiny_config("llama"),  # vocabulary 384 > the tokenizer's 369
        image_token_index=image_token_id,
        vision_feature_select_strategy=strategy,
        vision_feature_layer=feature_layer,
        image_seq_length=(IMAGE_SIZE // PATCH_SIZE) ** 2,
    )
    model = transformers.LlavaForConditionalGeneration(config)
    return _save(path, f"tiny-llava-{vision}", model, tokenizer, processor, seed)


def llava_tokenizer() -> Any:
    """The tiny ChatML tokenizer + the "<image>" special token and the parts-aware template."""
    tokenizer = make_tiny_tokenizer()
    tokenizer.add_tokens([IMAGE_TOKEN], special_tokens=True)
    tokenizer.chat_template = LLAVA_TEMPLATE
    if len(tokenizer) > TINY_VOCAB_SIZE:
        raise AssertionError("the tiny vocabulary no longer covers the tokenizer")
    return tokenizer


def _save(
    path: str | Path, name: str, model: Any, tokenizer: Any, processor: Any, seed: int
) -> Path:
    out = _free_folder(Path(path), name)
    seed_weights(model, seed, _draw).save_pretrained(out)
    tokenizer.save_pretrained(out)
    processor.save_pretrained(out)
    return out


def _draw(name: str, shape: torch.Size, gen: torch.Generator) -> torch.Tensor:
    noise = torch.randn(shape, generator=gen)
    if name.endswith("bias"):
        return 0.2 * noise
    if "norm" in name:  # LayerNorm/RMSNorm weights near 1, but not 1
        return 1.0 + 0.2 * noise
    if len(shape) < 2 or "embed" in name:  # embeddings, CLS token, probe, logit scales
        return noise
    return noise / shape[1:].numel() ** 0.5  # fan-in scaling (conv: channels x patch area)


@torch.no_grad()
def transformers_embeddings(
    folder: Path, inputs: list[Any], device: str = "cpu", normalize: bool = True
) -> torch.Tensor:
    """transformers' get_text_features / get_image_features of a CLIP or SigLIP folder, one
    row per input (a text or a PIL image), in float32; SigLIP's texts padded to its 64
    positions, as its processor pads them (and as the engine does)."""
    from transformers import AutoImageProcessor, AutoModel, AutoTokenizer

    hf = AutoModel.from_pretrained(folder, dtype=torch.float32).to(device).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    processor = AutoImageProcessor.from_pretrained(folder)
    pad = {"padding": "max_length", "max_length": 64} if hf.config.model_type == "siglip" else {}
    rows = []
    for x in inputs:
        if isinstance(x, str):
            ids = torch.tensor([tokenizer(x, **pad)["input_ids"]], device=device)
            out = hf.get_text_features(input_ids=ids)
        else:
            pixels = processor(images=[x], return_tensors="pt")["pixel_values"].to(device)
            out = hf.get_image_features(pixel_values=pixels)
        # a tensor, or (transformers 5) an output with pooler_output
        rows.append((out if isinstance(out, torch.Tensor) else out.pooler_output)[0].float().cpu())
    stacked = torch.stack(rows)
    return torch.nn.functional.normalize(stacked, dim=-1) if normalize else stacked
