"""sentence-transformers' prompts and its Normalize module, as its encode() applies them: the
default prompt (config_sentence_transformers.json's default_prompt_name) before each text, a
named one on request, none with ""; a pipeline without Normalize gives raw vectors by
default (dot-product models), while gRPC's unset normalize stays true (API.md)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from mmserve.errors import InvalidArgument
from tests.pooling.conftest import load_llm
from tests.pooling.tiny_pooling_models import make_tiny_bert

TEXTS = ["hello world", "  The quick brown fox jumps over the lazy dog. ", "Paris"]
PROMPTS = {"query": "query: ", "passage": "passage: "}


def make_st(out: Path, *, normalize: bool, default_prompt_name: str | None) -> Path:
    """Tiny BERT -> mean pooling (-> Normalize), with PROMPTS, saved by sentence-transformers."""
    pytest.importorskip("sentence_transformers")
    from sentence_transformers import SentenceTransformer, models

    encoder = make_tiny_bert(out / "encoder", num_labels=None, seed=11)
    transformer = models.Transformer(str(encoder), max_seq_length=48)
    modules: list[Any] = [
        transformer,
        models.Pooling(transformer.get_word_embedding_dimension(), pooling_mode="mean"),
    ]
    if normalize:
        modules.append(models.Normalize())
    st = SentenceTransformer(
        modules=modules, device="cpu", prompts=PROMPTS, default_prompt_name=default_prompt_name
    )
    st.save(str(out / "st"))
    return out / "st"


def st_encode(path: Path, **kwargs: Any) -> torch.Tensor:
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(path), device="cpu")
    return model.encode(TEXTS, convert_to_tensor=True, **kwargs).float()


def test_prompts_as_sentence_transformers_applies_them(tmp_path: Path) -> None:
    path = make_st(tmp_path, normalize=True, default_prompt_name="query")
    llm: Any = load_llm(path)
    try:
        assert llm.frontend.info.default_prompt_name == "query"
        close = {"atol": 1e-5, "rtol": 1e-4}
        # no prompt_name: the default prompt ("query: "), as encode() with no prompt given
        default = torch.tensor(llm.embed(TEXTS))
        torch.testing.assert_close(default, st_encode(path), **close)
        passage = torch.tensor(llm.embed(TEXTS, prompt_name="passage"))
        torch.testing.assert_close(passage, st_encode(path, prompt_name="passage"), **close)
        bare = torch.tensor(llm.embed(TEXTS, prompt_name=""))
        torch.testing.assert_close(bare, st_encode(path, prompt=""), **close)
        assert (default - bare).abs().max() > 1e-3  # the prompt changed the vectors
        # token ids get no prompt: the text's own ids embed as the bare text does
        ids = llm.frontend.tokenizer(TEXTS[0])["input_ids"]
        torch.testing.assert_close(torch.tensor(llm.embed([ids]))[0], bare[0], **close)
        with pytest.raises(InvalidArgument, match=r"prompt_name: unknown prompt 'doc'.*passage"):
            llm.embed(TEXTS, prompt_name="doc")
        # cosine scores embed with the default prompt too, as encode() then similarity()
        first, second = st_encode(path)[:1], st_encode(path)[1:]
        scores = llm.score(TEXTS[0], TEXTS[1:])
        expected = (first * second).sum(-1)
        torch.testing.assert_close(torch.tensor(scores), expected, **close)
    finally:
        llm.shutdown()


def test_a_pipeline_without_normalize_embeds_unnormalised(tmp_path: Path) -> None:
    path = make_st(tmp_path, normalize=False, default_prompt_name=None)
    llm: Any = load_llm(path)
    try:
        assert not llm.frontend.info.normalize
        ours = torch.tensor(llm.embed(TEXTS))
        expected = st_encode(path)
        torch.testing.assert_close(ours, expected, atol=1e-5, rtol=1e-4)
        assert (expected.norm(dim=-1) - 1).abs().max() > 1e-2  # raw vectors indeed
        unit = torch.tensor(llm.embed(TEXTS, normalize=True))
        torch.testing.assert_close(unit, torch.nn.functional.normalize(expected, dim=-1), atol=1e-5, rtol=1e-4)
    finally:
        llm.shutdown()


def test_grpc_leaves_normalize_true_when_unset() -> None:
    from mmserve.server.convert_pooling import embed_options
    from mmserve_client.v1 import pooling_pb2

    options = embed_options(pooling_pb2.EmbedRequest(inputs=[]))
    assert options.normalize is True and options.prompt_name is None
    named = embed_options(pooling_pb2.EmbedRequest(prompt_name=""))
    assert named.prompt_name == ""  # set but empty: no prompt, not the default
