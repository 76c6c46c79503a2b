"""Tiny random Qwen2-VL / Qwen2.5-VL checkpoints (fixed seeds) for tests, and a paged-KV
stepper that feeds [3, T] positions and input embeddings.

    path = make_tiny_qwen2_vl(tmp_path, version="2.5")
    processor = AutoImageProcessor.from_pretrained(path)  # patch 4, merge 2: 8-pixel grid
    tokenizer = AutoTokenizer.from_pretrained(path)  # tiny BPE + vision specials + template

The folder holds the safetensors weights, config, a Qwen2-VL image processor (PIL backend) with
small min/max pixels so that images give a few dozen patches, and the tiny ChatML tokenizer of
tiny_models with <|vision_start|>, <|vision_end|>, <|image_pad|>, <|video_pad|> added.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from mmserve.bench.models import CHATML_VL_TEMPLATE
from tests.models.paged import PagedKV, PagedSeq
from tests.utils.tiny_models import (
    TINY_VOCAB_SIZE,
    _draw,
    _free_folder,
    make_tiny_tokenizer,
    seed_weights,
)

VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
PATCH_SIZE = 4
MIN_PIXELS = 8 * 8 * 4
MAX_PIXELS = 48 * 48
VL_TEMPLATE = CHATML_VL_TEMPLATE  # ChatML; an image part is one <|image_pad|>


def make_tiny_vl_tokenizer() -> Any:
    tokenizer = make_tiny_tokenizer()
    tokenizer.add_tokens(list(VISION_TOKENS), special_tokens=True)
    tokenizer.chat_template = VL_TEMPLATE
    if len(tokenizer) > TINY_VOCAB_SIZE:
        raise ValueError(f"tokenizer has {len(tokenizer)} tokens > {TINY_VOCAB_SIZE}")
    return tokenizer


def tiny_qwen2_vl_config(version: str = "2", **overrides: Any) -> Any:
    """Text: hidden 64, 2 layers, 4 heads of 16, 2 KV heads, mrope_section [2, 3, 3].
    Vision: depth 2, width 32, 4 heads, patch 4, temporal patch 2, merge 2; for 2.5 also
    16-pixel windows (2x2 merged tokens) with block 1 attending over the whole image."""
    import transformers

    tokenizer = make_tiny_vl_tokenizer()
    start, end, image, video = tokenizer.convert_tokens_to_ids(list(VISION_TOKENS))
    text = {
        "vocab_size": TINY_VOCAB_SIZE,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 512,
        "rms_norm_eps": 1e-6,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10000.0,
            "mrope_section": [2, 3, 3],
        },
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }
    vision: dict[str, Any] = {"depth": 2, "num_heads": 4, "patch_size": PATCH_SIZE}
    config_class: Any  # both accept the top-level special token ids, which their stubs omit
    if version == "2":
        vision |= {"embed_dim": 32, "hidden_size": 64, "mlp_ratio": 2}
        config_class = transformers.Qwen2VLConfig
    elif version == "2.5":
        vision |= {
            "hidden_size": 32,
            "out_hidden_size": 64,
            "intermediate_size": 48,
            "window_size": 16,
            "fullatt_block_indexes": [1],
        }
        config_class = transformers.Qwen2_5_VLConfig
    else:
        raise ValueError(f"unknown version {version!r}; choose '2' or '2.5'")
    return config_class(
        text_config=text,
        vision_config=vision,
        image_token_id=image,
        video_token_id=video,
        vision_start_token_id=start,
        vision_end_token_id=end,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **overrides,
    )


def make_tiny_hf_qwen2_vl(version: str = "2", seed: int = 0, **overrides: Any) -> Any:
    """The transformers model in float32, eval mode, with seeded O(1)-scale weights;
    overrides go to the top-level config (e.g. tie_word_embeddings=True)."""
    import transformers

    config = tiny_qwen2_vl_config(version, **overrides)
    name = (
        "Qwen2VLForConditionalGeneration"
        if version == "2"
        else "Qwen2_5_VLForConditionalGeneration"
    )
    return seed_weights(getattr(transformers, name)(config).eval(), seed, _draw_vl)


def _draw_vl(name: str, shape: torch.Size, gen: torch.Generator) -> torch.Tensor:
    """tiny_models._draw, with the merger's ln_q drawn as a norm and the Conv3d patch
    embedding scaled by its true fan-in (C*T*P*P)."""
    if len(shape) > 2:
        return torch.randn(shape, generator=gen) / shape[1:].numel() ** 0.5
    return _draw(name.replace("ln_q", "norm"), shape, gen)


def make_tiny_qwen2_vl(
    path: str | Path, version: str = "2", *, seed: int = 0, **overrides: Any
) -> Path:
    """Saves the tiny model, image processor and tokenizer under path/tiny-qwen{version}-vl
    (numbered if taken) and returns that folder."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    out = _free_folder(Path(path), f"tiny-qwen{version}-vl")
    make_tiny_hf_qwen2_vl(version, seed, **overrides).save_pretrained(out)
    processor = Qwen2VLImageProcessorPil(
        min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS, patch_size=PATCH_SIZE, merge_size=2
    )
    processor.save_pretrained(out)
    make_tiny_vl_tokenizer().save_pretrained(out)
    return out


class MRopePagedKV(PagedKV):
    """PagedKV whose step takes each sequence's positions [3, n] and input embeddings [n, H]
    (the runner's path for M-RoPE models), instead of token ids and 1-D positions."""

    def step_embeds(
        self, model: Any, batch: list[tuple[PagedSeq, torch.Tensor, torch.Tensor]]
    ) -> torch.Tensor:
        """batch: (sequence, positions [3, n], embeddings [n, hidden]) -> fp32 logits
        [total n, vocab] in batch order."""
        slots: list[int] = []
        for seq, positions, _ in batch:
            start = seq.num_computed
            seq.num_computed += positions.shape[1]
            while len(seq.blocks) * self.block_size < seq.num_computed:
                seq.blocks.append(self.free.pop())
            slots += [self._slot(seq, p) for p in range(start, seq.num_computed)]
        lengths = [p.shape[1] for _, p, _ in batch]
        meta = self._metadata([s for s, _, _ in batch], lengths, slots)
        device = self.caches[0].device
        positions = torch.cat([p for _, p, _ in batch], dim=1).to(device)
        embeds = torch.cat([e for _, _, e in batch]).to(device)
        ids = torch.zeros(embeds.shape[0], dtype=torch.long, device=device)  # unused
        hidden = model.forward(ids, positions, self.caches, meta, inputs_embeds=embeds)
        return model.compute_logits(hidden)  # type: ignore[no-any-return]
