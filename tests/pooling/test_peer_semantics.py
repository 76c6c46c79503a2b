"""Pooling against sentence-transformers' own classes on the same tiny weights, where they
decide more than transformers' forward does: CrossEncoder.predict's default activation (read
from the model's config; ms-marco cross-encoders return raw logits), texts tokenised as given
(surrounding whitespace is part of a byte-level BPE or SentencePiece input), and folders saved
by sentence-transformers 6 ("pooling_mode": "lasttoken").

The references load copies without the tokenizer's chat template: sentence-transformers 6
would render the pairs through it, which no serving peer (vLLM, TEI) does for these models."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.pooling.conftest import load_llm

st = pytest.importorskip("sentence_transformers")

QUERY = "What is the capital of France?"
# leading spaces, trailing newlines and spaces: tokens of their own for BPE / SentencePiece
DOCS = ["The capital of France is Paris.", "  The quick brown fox.\n", "Paris\n\n", "hello world "]
IDENTITY = "torch.nn.modules.linear.Identity"
TANH = "torch.nn.modules.activation.Tanh"


def copy_without_chat_template(path: Path, out: Path) -> Path:
    shutil.copytree(path, out)
    (out / "chat_template.jinja").unlink(missing_ok=True)
    config_file = out / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config.pop("chat_template", None)
    config_file.write_text(json.dumps(config))
    return out


def edit_config(path: Path, **fields: Any) -> Path:
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, **fields}))
    return path


@pytest.mark.parametrize("name", ["bert-cross-encoder", "xlmr-cross-encoder", "qwen2-cross-encoder"])
def test_scores_and_ranks_equal_cross_encoder_on_texts_as_given(
    name: str, tiny_models: Callable[[str], Path], tmp_path: Path
) -> None:
    path = copy_without_chat_template(tiny_models(name), tmp_path / name)
    reference = st.CrossEncoder(str(path), device="cpu")
    llm: Any = load_llm(path)
    try:
        expected = reference.predict([(QUERY, d) for d in DOCS], convert_to_tensor=True)
        assert llm.score(QUERY, DOCS) == pytest.approx(expected.tolist(), abs=1e-5)
        ranked = llm.rerank(QUERY, DOCS)
        assert [r.index for r in ranked] == expected.argsort(descending=True).tolist()
    finally:
        llm.shutdown()


def _st6_saved_identity(path: Path, out: Path) -> Path:
    reference = st.CrossEncoder(str(path), device="cpu", activation_fn=torch.nn.Identity())
    reference.save(str(out))
    return out


# how a cross-encoder's folder names its default activation, and what CrossEncoder applies
ACTIVATION_CONFIGS: dict[str, tuple[Callable[[Path, Path], Path], str]] = {
    # sentence-transformers < 4 (cross-encoder/ms-marco-MiniLM-L6-v2's config.json)
    "legacy-identity": (
        lambda p, out: edit_config(
            shutil.copytree(p, out), sbert_ce_default_activation_function=IDENTITY
        ),
        "Identity",
    ),
    # sentence-transformers 4 and 5
    "config-tanh": (
        lambda p, out: edit_config(
            shutil.copytree(p, out), sentence_transformers={"activation_fn": TANH}
        ),
        "Tanh",
    ),
    # sentence-transformers 6: config_sentence_transformers.json beside modules.json
    "st6-identity": (_st6_saved_identity, "Identity"),
    # a class outside torch: CrossEncoder ignores it (no trust_remote_code), so do we
    "untrusted": (
        lambda p, out: edit_config(
            shutil.copytree(p, out), sbert_ce_default_activation_function="mypackage.Act"
        ),
        "Sigmoid",
    ),
}


@pytest.mark.parametrize("case", ACTIVATION_CONFIGS)
def test_cross_encoder_activation_follows_the_model_config(
    case: str, tiny_models: Callable[[str], Path], tmp_path: Path
) -> None:
    make, activation = ACTIVATION_CONFIGS[case]
    path = make(tiny_models("bert-cross-encoder"), tmp_path / case)
    reference = st.CrossEncoder(str(path), device="cpu")
    assert type(reference.activation_fn).__name__ == activation
    llm: Any = load_llm(path)
    try:
        expected = reference.predict([(QUERY, d) for d in DOCS], convert_to_tensor=True)
        assert llm.score(QUERY, DOCS) == pytest.approx(expected.tolist(), abs=1e-5)
        assert [r.score for r in llm.rerank(QUERY, DOCS)] == pytest.approx(
            expected.sort(descending=True).values.tolist(), abs=1e-5
        )
        # Classify still gives a probability: the sigmoid of the one logit
        with torch.no_grad():
            features = reference.tokenizer([DOCS[0]], return_tensors="pt")
            logit = reference.model(**features).logits[0, 0]
        (result,) = llm.classify([DOCS[0]])
        assert result.scores[0].score == pytest.approx(torch.sigmoid(logit).item(), abs=1e-5)
    finally:
        llm.shutdown()


def test_st6_last_token_embedder_equals_sentence_transformer(
    tiny_models: Callable[[str], Path], tmp_path: Path
) -> None:
    """A decoder saved by sentence-transformers 6 (1_Pooling: "pooling_mode": "lasttoken")
    loads, and embeds each text as given, its surrounding whitespace included."""
    from sentence_transformers import models

    backbone = copy_without_chat_template(tiny_models("mistral-backbone"), tmp_path / "backbone")
    transformer = models.Transformer(str(backbone), max_seq_length=64)
    modules = [
        transformer,
        models.Pooling(transformer.get_embedding_dimension(), pooling_mode="lasttoken"),
        models.Normalize(),
    ]
    st.SentenceTransformer(modules=modules, device="cpu").save(str(tmp_path / "st"))
    reference = st.SentenceTransformer(str(tmp_path / "st"), device="cpu")
    texts = ["hello world", " hello world\n", "Paris  ", "\tdef main():"]
    expected = reference.encode(texts, convert_to_tensor=True).float()
    llm: Any = load_llm(tmp_path / "st")
    try:
        ours = torch.tensor(llm.embed(texts))
    finally:
        llm.shutdown()
    torch.testing.assert_close(ours, expected, atol=1e-5, rtol=1e-4)
