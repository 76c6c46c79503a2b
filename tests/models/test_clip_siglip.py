"""CLIP and SigLIP dual encoders and vision towers against transformers, on tiny random
checkpoints: image and text features, and the towers' hidden states."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from mmserve.attention import AttentionMetadata
from mmserve.errors import InvalidArgument, UnsupportedModel
from mmserve.models.clip import CLIPModel
from mmserve.models.loader import iter_safetensors_weights
from mmserve.models.siglip import SiglipModel
from tests.utils.tiny_vlm import make_tiny_clip, make_tiny_siglip

TEXTS = ["a photo of a cat", "Hello world, this is a test of the tiny tokenizer.", "dog", "0 + 1"]
ATOL = 1e-4


def _load(cls: type, folder: Path) -> tuple[Any, Any]:
    """(ours, transformers') for one folder, both float32 in eval mode."""
    import transformers

    hf = transformers.AutoModel.from_pretrained(folder).eval()
    ours = cls(hf.config, None)
    ours.load_weights(iter_safetensors_weights(folder))
    return ours.eval(), hf


def _images(folder: Path, sizes: list[tuple[int, int]]) -> torch.Tensor:
    """Random RGB images of the given (width, height) through the folder's image processor."""
    from PIL import Image
    from transformers import AutoImageProcessor

    rng = np.random.default_rng(0)
    images = [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for w, h in sizes]
    processor = AutoImageProcessor.from_pretrained(folder)
    return processor(images=images, return_tensors="pt")["pixel_values"]


def _encoder_meta(lengths: list[int]) -> AttentionMetadata:
    starts = np.concatenate([[0], np.cumsum(lengths)]).tolist()
    return AttentionMetadata(
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(lengths, dtype=torch.int32),
        block_tables=torch.zeros(len(lengths), 0, dtype=torch.int32),
        slot_mapping=torch.full((sum(lengths),), -1, dtype=torch.int64),
        max_query_len=max(lengths),
        max_seq_len=max(lengths),
        query_lens_cpu=lengths,
        seq_lens_cpu=lengths,
        causal=False,
    )


def _text_features(ours: Any, texts: list[list[int]]) -> torch.Tensor:
    """All texts as one flat batch through forward(), then pool_text() per text."""
    lengths = [len(t) for t in texts]
    ids = torch.tensor([i for t in texts for i in t])
    positions = torch.tensor([p for n in lengths for p in range(n)])
    with torch.no_grad():
        hidden = ours.forward(ids, positions, [], _encoder_meta(lengths))
        rows = hidden.split(lengths)
        return torch.stack([ours.pool_text(r, t) for r, t in zip(rows, texts, strict=True)])


def _hf_text_features(hf: Any, texts: list[list[int]]) -> torch.Tensor:
    with torch.no_grad():
        return torch.cat([hf.get_text_features(torch.tensor([t])).pooler_output for t in texts])


def _token_ids(folder: Path, eos: int | None) -> list[list[int]]:
    """The texts' ids, with eos appended to all but the last (which then has none)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    ids = [tokenizer(t).input_ids for t in TEXTS]
    if eos is not None:
        ids = [t + [eos] for t in ids[:-1]] + ids[-1:]
    return ids


@pytest.fixture(scope="module")
def clip(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any, Any]:
    folder = make_tiny_clip(tmp_path_factory.mktemp("clip"))
    return (folder, *_load(CLIPModel, folder))


@pytest.fixture(scope="module")
def siglip(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any, Any]:
    folder = make_tiny_siglip(tmp_path_factory.mktemp("siglip"))
    return (folder, *_load(SiglipModel, folder))


@pytest.mark.parametrize("kind", ["clip", "siglip"])
def test_image_features_match_transformers(kind: str, request: pytest.FixtureRequest) -> None:
    folder, ours, hf = request.getfixturevalue(kind)
    pixel_values = _images(folder, [(40, 30), (25, 50)])
    with torch.no_grad():
        expected = hf.get_image_features(pixel_values).pooler_output
        got = ours.embed_images(pixel_values)
    assert got.shape == (2, ours.hidden_size) and got.dtype == torch.float32
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)


def test_clip_text_features_legacy_eos_rule(clip: tuple[Path, Any, Any]) -> None:
    folder, ours, hf = clip
    assert hf.config.text_config.eos_token_id == 2  # pools at the argmax of the ids
    texts = _token_ids(folder, eos=2)
    got = _text_features(ours, texts)
    assert got.shape == (len(TEXTS), ours.hidden_size)
    torch.testing.assert_close(got, _hf_text_features(hf, texts), atol=ATOL, rtol=0)


def test_clip_text_features_first_eos(tmp_path: Path) -> None:
    folder = make_tiny_clip(tmp_path, eos_token_id=1)  # pools at the first id 1 (else at 0)
    ours, hf = _load(CLIPModel, folder)
    texts = _token_ids(folder, eos=1)
    texts[0] = texts[0] + [5, 6]  # tokens after the eos must not move the pooled row
    torch.testing.assert_close(
        _text_features(ours, texts), _hf_text_features(hf, texts), atol=ATOL, rtol=0
    )


def test_siglip_text_features(siglip: tuple[Path, Any, Any]) -> None:
    folder, ours, hf = siglip
    texts = _token_ids(folder, eos=None)
    texts.append(texts[0] + [0] * 6)  # padded as SigLIP's processor pads (max_length)
    got = _text_features(ours, texts)
    torch.testing.assert_close(got, _hf_text_features(hf, texts), atol=ATOL, rtol=0)


@pytest.mark.parametrize("kind", ["clip", "siglip"])
def test_tower_hidden_states_match_output_hidden_states(
    kind: str, request: pytest.FixtureRequest
) -> None:
    folder, ours, hf = request.getfixturevalue(kind)
    pixel_values = _images(folder, [(30, 30), (64, 20)])
    indices = [0, 1, 2, -1, -2, -3]
    with torch.no_grad():
        expected = hf.vision_model(pixel_values, output_hidden_states=True).hidden_states
        got = ours.vision_model.hidden_states(pixel_values, indices)
    for i, state in zip(indices, got, strict=True):
        torch.testing.assert_close(state, expected[i], atol=ATOL, rtol=0)


def test_attributes_the_engine_reads(clip: tuple[Path, Any, Any]) -> None:
    _, ours, hf = clip
    caps = ours.capabilities
    assert ours.num_layers == 0 and caps.dual_encoder and not caps.causal
    assert ours.hidden_size == hf.config.projection_dim
    assert ours.vocab_size == hf.config.text_config.vocab_size
    assert ours.max_text_len == hf.config.text_config.max_position_embeddings


def test_wrong_image_size_and_long_text_raise(clip: tuple[Path, Any, Any]) -> None:
    _, ours, _ = clip
    with pytest.raises(InvalidArgument, match="pixel_values"):
        ours.embed_images(torch.zeros(1, 3, 32, 32))
    length = ours.max_text_len + 1
    with pytest.raises(InvalidArgument, match="input_ids"):
        ours.forward(
            torch.zeros(length, dtype=torch.long), torch.arange(length), [], _encoder_meta([length])
        )


def test_load_weights_rejects_missing_and_unknown(clip: tuple[Path, Any, Any]) -> None:
    folder, _, hf = clip
    weights = list(iter_safetensors_weights(folder))
    with pytest.raises(UnsupportedModel, match="lacks"):
        CLIPModel(hf.config, None).load_weights(
            [w for w in weights if w[0] != "text_projection.weight"]
        )
    with pytest.raises(UnsupportedModel, match="unexpected"):
        CLIPModel(hf.config, None).load_weights([*weights, ("text_model.extra", torch.zeros(1))])
