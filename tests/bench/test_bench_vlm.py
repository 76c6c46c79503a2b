"""`mmserve bench vlm` end to end on a tiny random Qwen2-VL (one line per phase, the caches
doing what each phase is for, the encoder line), and the qwen2-vl-7b benchmark shape's folder
(config, tokenizer with the vision tokens and chat template, image processor), without
building the 7B model."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from mmserve.bench.models import make_model_folder
from mmserve.bench.vlm import PHASES, parse_image_size
from tests.bench.conftest import bench_args
from tests.utils.tiny_qwen_vl import make_tiny_qwen2_vl


def _args(*flags: str) -> argparse.Namespace:
    return bench_args("vlm", *flags)


def test_image_size_parsing() -> None:
    assert parse_image_size("448x336") == (448, 336)
    for bad in ("448", "0x10", "axb", "1x2x3"):
        with pytest.raises(ValueError, match="--image-size"):
            parse_image_size(bad)


def test_bench_vlm_on_a_tiny_qwen2_vl(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], one_thread: None
) -> None:
    model = make_tiny_qwen2_vl(tmp_path)
    args = _args(
        "--model", str(model), "--device", "cpu", "--dtype", "float32",
        "--max-model-len", "256", "--num-kv-blocks", "64",
        "--num-images", "3", "--image-size", "40x24",
    )  # fmt: skip
    args.func(args)
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    ttft = {line["phase"]: line for line in lines if line["bench"] == "vlm-ttft"}
    assert list(ttft) == list(PHASES)
    cold, warm, hit = (ttft[p] for p in PHASES)
    image_tokens = cold["image_tokens"]
    assert image_tokens == 15  # 40x24 -> 24x40 pixels -> 6x10 patches of 4 -> 3x5 merged
    for line in ttft.values():
        assert line["device"] == "cpu" and line["num_images"] == 3 and line["block_size"] == 16
        assert line["cache_as_expected"] is True
        assert 0 < line["ttft_ms_median"] <= line["ttft_ms_p90"]
        assert 0 < line["engine_ms_median"] <= line["engine_ms_p90"] < line["ttft_ms_p90"]
    assert hit["prompt_tokens"] == cold["prompt_tokens"] < warm["prompt_tokens"]
    assert cold["encoder_runs"] == 3 and warm["encoder_runs"] == hit["encoder_runs"] == 0
    assert cold["num_cached_tokens"] == warm["num_cached_tokens"] == [0, 0, 0]
    assert all(n >= image_tokens for n in hit["num_cached_tokens"])
    (encoder,) = [line for line in lines if line["bench"] == "vlm-encoder"]
    assert encoder["image_tokens"] == image_tokens and encoder["encoder_ms_median"] > 0
    assert not [line for line in lines if line["bench"] == "vlm-transformers-forward"]


def test_qwen2_vl_7b_shape_folder(tmp_path: Path) -> None:
    from transformers import AutoConfig, AutoImageProcessor

    from mmserve.bench.vlm import conversation, random_image
    from mmserve.models.qwen2_vl_vision import vision_spec
    from mmserve.processors.chat_template import render_and_tokenize
    from mmserve.processors.tokenizer import load_tokenizer

    folder = make_model_folder("qwen2-vl-7b", tmp_path / "model")
    config = AutoConfig.from_pretrained(folder, local_files_only=True)
    text = config.text_config
    assert (text.hidden_size, text.num_hidden_layers, text.num_key_value_heads) == (3584, 28, 4)
    assert text.rope_parameters["mrope_section"] == [16, 24, 24] and text.vocab_size == 152064
    spec = vision_spec(config)
    assert (spec.depth, spec.embed_dim, spec.mlp_dim, spec.out_dim) == (32, 1280, 5120, 3584)
    tokenizer = load_tokenizer(folder)
    vocab = tokenizer.get_vocab()
    specials = ("vision_start", "image", "vision_end")
    ids = [getattr(config, f"{name}_token_id") for name in specials]
    assert ids == [vocab[t] for t in ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>")]
    assert vocab["<|im_end|>"] == config.eos_token_id and max(ids) < text.vocab_size
    _, prompt = render_and_tokenize(tokenizer, conversation(None), allow_images=True)
    assert prompt[:6] == [vocab["<|im_start|>"], *tokenizer.encode("user\n"), *ids]
    processor = AutoImageProcessor.from_pretrained(folder, local_files_only=True)
    grid = processor(images=[random_image((448, 448), 0)], return_tensors="pt")["image_grid_thw"]
    assert grid.tolist() == [[1, 32, 32]]  # 14-pixel patches: 256 tokens after the 2x2 merge
