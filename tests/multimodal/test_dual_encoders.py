"""CLIP and SigLIP through Embed (offline API): text and image embeddings equal transformers'
get_text_features / get_image_features on the same tiny random checkpoint, mixed in one call."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import PIL.Image
import pytest
import torch

from mmserve.entrypoints.llm import LLM
from mmserve.errors import InvalidArgument
from tests.utils.tiny_vlm import make_tiny_clip, make_tiny_siglip, transformers_embeddings


def picture(height: int, width: int, seed: int) -> PIL.Image.Image:
    rng = np.random.RandomState(seed)
    return PIL.Image.fromarray(rng.randint(0, 256, (height, width, 3), dtype=np.uint8))


@pytest.fixture(scope="module", params=["clip", "siglip"])
def folder(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    make = make_tiny_clip if request.param == "clip" else make_tiny_siglip
    return make(tmp_path_factory.mktemp(request.param))


def test_text_and_image_embeddings_match_transformers(folder: Path) -> None:
    llm = LLM(str(folder))
    assert llm.tasks == ("embed", "score")
    inputs = ["a photo of a cat", picture(40, 30, 0), "two dogs", picture(28, 28, 1), "x"]
    ours = torch.tensor(llm.embed(inputs))
    assert torch.allclose(ours, transformers_embeddings(folder, inputs), atol=1e-5)
    raw = torch.tensor(llm.embed(inputs[1], normalize=False))
    expected_raw = transformers_embeddings(folder, inputs[1:2], normalize=False)
    assert torch.allclose(raw, expected_raw, atol=1e-4)


def test_image_errors_name_the_input(folder: Path) -> None:
    llm = LLM(str(folder))
    with pytest.raises(InvalidArgument, match=r"inputs\[1\].*too small"):
        llm.embed(["a", picture(1, 1, 0)])
    with pytest.raises(InvalidArgument, match=r"inputs\[0\].*not a supported image"):
        llm.embed(b"not an image")


def test_score_texts_against_images_is_cosine(folder: Path) -> None:
    llm = LLM(str(folder))
    assert "score" in llm.tasks
    images = [picture(40, 30, 5), picture(28, 28, 6)]
    scores = llm.score("a photo of a cat", images)
    text, *vectors = (torch.tensor(v) for v in llm.embed(["a photo of a cat", *images]))
    assert scores == pytest.approx([float(text @ v) for v in vectors], abs=1e-5)
    pairwise = llm.score([images[0], "dogs"], ["a cat", images[1]])
    a = torch.tensor(llm.embed([images[0], "dogs"]))
    b = torch.tensor(llm.embed(["a cat", images[1]]))
    assert pairwise == pytest.approx((a * b).sum(-1).tolist(), abs=1e-5)
