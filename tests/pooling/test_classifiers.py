"""Tiny random BERT, XLM-RoBERTa and Llama-family classifiers against transformers' logits;
cross-encoder scores and rerank order against transformers' scores."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from mmserve.entrypoints.llm import LLM
from mmserve.frontend.pooling import PoolingPlan, run_sync
from mmserve.params import PoolingParams
from tests.pooling.conftest import load_llm
from tests.pooling.tiny_pooling_models import LABELS

ATOL = 1e-4
TEXTS = [
    "hello world",
    "The quick brown fox jumps over the lazy dog.",
    "What is the capital of France? Paris.",
    "x",
]
QUERY = "What is the capital of France?"
DOCS = [
    "The capital of France is Paris.",
    "The quick brown fox.",
    "Paged attention stores keys and values in blocks.",
    "hello world, this is a test",
    "Paris",
]
CLASSIFIERS = [
    "bert-classifier",
    "xlmr-classifier",
    "roberta-classifier",
    "llama-classifier",
    "qwen2-classifier",
]
CROSS_ENCODERS = ["bert-cross-encoder", "xlmr-cross-encoder"]


def hf_model(path: Path) -> torch.nn.Module:
    from transformers import AutoModelForSequenceClassification

    return AutoModelForSequenceClassification.from_pretrained(str(path)).eval()


def hf_logits(path: Path, encodings: list[dict[str, list[int]]]) -> torch.Tensor:
    """transformers' logits, one unpadded input at a time: [N, num_labels]."""
    model = hf_model(path)
    rows = []
    with torch.no_grad():
        for enc in encodings:
            tensors = {k: torch.tensor([v]) for k, v in enc.items() if k != "attention_mask"}
            rows.append(model(**tensors).logits[0])
    return torch.stack(rows)


def hf_tokenize(path: Path, *texts: str) -> dict[str, list[int]]:
    from transformers import AutoTokenizer

    return dict(AutoTokenizer.from_pretrained(str(path))(*texts))


def raw_logits(llm: LLM, inputs: list[list[int]]) -> torch.Tensor:
    """Our classifier logits without activation, for token-id inputs."""
    encoded = llm.frontend.input_encoder.encode(inputs, "none", "inputs")
    plan = PoolingPlan(
        len(encoded),
        PoolingParams("classify", activation=False),
        lambda start, end: encoded[start:end],
        lambda pooled, _tokens: torch.stack(pooled),
    )
    return run_sync(llm.frontend, plan)


@pytest.mark.parametrize("name", CLASSIFIERS)
def test_classifier_logits_match_transformers(
    name: str, tiny_models: Callable[[str], Path], tiny_llms: Callable[[str], LLM]
) -> None:
    path, llm = tiny_models(name), tiny_llms(name)
    assert llm.tasks == ("classify",)
    assert llm.frontend.info.labels == tuple(LABELS.values())
    encodings = [hf_tokenize(path, t) for t in TEXTS]
    expected = hf_logits(path, encodings)
    ours = raw_logits(llm, [e["input_ids"] for e in encodings])
    torch.testing.assert_close(ours, expected, atol=ATOL, rtol=1e-4)
    # the public path: same tokens from text, softmax across labels, sorted
    results = llm.classify(TEXTS)
    for result, logits in zip(results, expected):
        probs = dict(zip(LABELS.values(), logits.softmax(-1).tolist()))
        assert result.label == max(probs, key=probs.__getitem__)
        assert [s.score for s in result.scores] == sorted(
            (s.score for s in result.scores), reverse=True
        )
        assert {s.label: s.score for s in result.scores} == pytest.approx(probs, abs=ATOL)


def test_xlm_roberta_positions_skip_padding_tokens(
    tiny_models: Callable[[str], Path], tiny_llms: Callable[[str], LLM]
) -> None:
    """A pad token inside an input keeps position padding_idx, as transformers numbers it."""
    path, llm = tiny_models("xlmr-classifier"), tiny_llms("xlmr-classifier")
    pad = llm.tokenizer.pad_token_id
    ids = [[1, 260, pad, 286, 299, 2], [1, 260, 286, 2]]
    expected = hf_logits(path, [{"input_ids": i} for i in ids])
    torch.testing.assert_close(raw_logits(llm, ids), expected, atol=ATOL, rtol=1e-4)


@pytest.mark.parametrize("name", CROSS_ENCODERS)
def test_cross_encoder_scores_and_rerank_match_transformers(
    name: str, tiny_models: Callable[[str], Path], tiny_llms: Callable[[str], LLM]
) -> None:
    path, llm = tiny_models(name), tiny_llms(name)
    assert llm.tasks == ("classify", "score", "rerank")
    assert llm.frontend.info.score_method == "cross-encoder"
    pairs = [hf_tokenize(path, QUERY, doc) for doc in DOCS]
    expected = torch.sigmoid(hf_logits(path, pairs)[:, 0])
    assert llm.score(QUERY, DOCS) == pytest.approx(expected.tolist(), abs=ATOL)
    ranked = llm.rerank(QUERY, DOCS)
    assert [r.index for r in ranked] == expected.argsort(descending=True).tolist()
    assert [r.score for r in ranked] == pytest.approx(
        expected.sort(descending=True).values.tolist(), abs=ATOL
    )
    top = llm.rerank(QUERY, DOCS, top_n=2)
    assert [r.index for r in top] == [r.index for r in ranked[:2]]


def test_bert_pairs_carry_segment_ids(
    tiny_models: Callable[[str], Path], tiny_llms: Callable[[str], LLM]
) -> None:
    """Pairwise scoring tokenises each pair as transformers does, token_type_ids included."""
    path, llm = tiny_models("bert-cross-encoder"), tiny_llms("bert-cross-encoder")
    encoded = llm.frontend.input_encoder.encode_pairs([(QUERY, DOCS[0])], "none", ["second[0]"])[0]
    reference = hf_tokenize(path, QUERY, DOCS[0])
    assert encoded.token_ids == reference["input_ids"]
    assert encoded.token_type_ids == reference["token_type_ids"]
    firsts = [QUERY, DOCS[1], "x"]
    scores = llm.score(firsts, DOCS[:3])
    expected = torch.sigmoid(
        hf_logits(path, [hf_tokenize(path, a, b) for a, b in zip(firsts, DOCS)])[:, 0]
    )
    assert scores == pytest.approx(expected.tolist(), abs=ATOL)


@pytest.mark.parametrize("name", ["bert-encoder", "xlmr-encoder"])
def test_bare_encoder_embeddings_match_transformers(
    name: str, tiny_models: Callable[[str], Path], tiny_llms: Callable[[str], LLM]
) -> None:
    """Without sentence-transformers files an encoder pools [CLS]; the flag picks another."""
    from transformers import AutoModel

    path, llm = tiny_models(name), tiny_llms(name)
    assert llm.tasks == ("embed", "score", "rerank")
    model = AutoModel.from_pretrained(str(path)).eval()
    with torch.no_grad():
        hidden = [model(torch.tensor([hf_tokenize(path, t)["input_ids"]]))[0][0] for t in TEXTS]
    cls = torch.stack([h[0] for h in hidden])
    torch.testing.assert_close(
        torch.tensor(llm.embed(TEXTS, normalize=False)), cls, atol=ATOL, rtol=1e-4
    )
    mean = torch.stack([h.mean(0) for h in hidden])
    by_flag = load_llm(path, pooling="mean").embed(TEXTS, normalize=False)
    torch.testing.assert_close(torch.tensor(by_flag), mean, atol=ATOL, rtol=1e-4)
