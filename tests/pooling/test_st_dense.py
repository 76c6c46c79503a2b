"""A sentence-transformers folder whose pipeline has a Dense module after pooling (LaBSE,
stella): our embeddings equal sentence-transformers' (projected, then normalised)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.pooling.conftest import load_llm
from tests.pooling.tiny_pooling_models import make_tiny_bert

TEXTS = ["hello world", "The quick brown fox jumps over the lazy dog.", "Paris", "x"]


def make_st_with_dense(out: Path, activation: torch.nn.Module) -> Path:
    """Tiny BERT -> CLS pooling -> Dense(32 -> 16, activation) -> Normalize, saved by
    sentence-transformers itself."""
    pytest.importorskip("sentence_transformers")
    from sentence_transformers import SentenceTransformer, models

    encoder = make_tiny_bert(out / "encoder", num_labels=None, seed=11)
    transformer = models.Transformer(str(encoder), max_seq_length=48)
    torch.manual_seed(0)
    modules = [
        transformer,
        models.Pooling(transformer.get_word_embedding_dimension(), pooling_mode="cls"),
        models.Dense(32, 16, activation_function=activation),
        models.Normalize(),
    ]
    SentenceTransformer(modules=modules, device="cpu").save(str(out / "st"))
    return out / "st"


@pytest.mark.parametrize("activation", [torch.nn.Tanh(), torch.nn.Identity()], ids=str)
def test_dense_module_embeddings_match_sentence_transformers(
    activation: torch.nn.Module, tmp_path: Path
) -> None:
    from sentence_transformers import SentenceTransformer

    path = make_st_with_dense(tmp_path, activation)
    expected = SentenceTransformer(str(path), device="cpu").encode(TEXTS, convert_to_tensor=True)
    llm: Any = load_llm(path)
    try:
        assert llm.frontend.info.embedding_size == 16
        ours = torch.tensor(llm.embed(TEXTS))
    finally:
        llm.shutdown()
    torch.testing.assert_close(ours, expected.float(), atol=1e-5, rtol=1e-4)
