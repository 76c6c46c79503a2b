"""The pure pooling conversions of mmserve.server.convert_pooling, without a server."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mmserve.errors import InvalidArgument
from mmserve.frontend.pooling_plans import (
    Classification,
    ClassifyResult,
    EmbedResult,
    LabelScore,
    RankedDocument,
    RerankResult,
    ScoreResult,
)
from mmserve.server import convert_pooling as cp
from mmserve.server.convert import model_info
from mmserve.server.models import ModelFacts, ModelHandle, Task
from mmserve_client.v1 import common_pb2, models_pb2, pooling_pb2

TIMING = common_pb2.Timing(queue_ms=1, first_token_ms=2, total_ms=2)


def test_truncate_defaults_to_none() -> None:
    assert cp.truncate_mode(common_pb2.TRUNCATE_UNSPECIFIED) == "none"
    assert cp.truncate_mode(common_pb2.TRUNCATE_NONE) == "none"
    assert cp.truncate_mode(common_pb2.TRUNCATE_LEFT) == "left"
    assert cp.truncate_mode(common_pb2.TRUNCATE_RIGHT) == "right"
    with pytest.raises(InvalidArgument, match="^truncate: unknown value 7"):
        cp.truncate_mode(7)


def test_inputs_texts_token_ids_and_refused_images() -> None:
    items = [
        common_pb2.Input(text="hi"),
        common_pb2.Input(token_ids=common_pb2.TokenIds(ids=[5, 6])),
        common_pb2.Input(token_ids=common_pb2.TokenIds()),  # empty: the plan refuses it
    ]
    assert cp.pooling_inputs("inputs", items) == ["hi", [5, 6], []]
    image = common_pb2.Input(image=common_pb2.Image(data=b"png"))
    with pytest.raises(InvalidArgument, match=r"^second\[1\]\.image: images are not supported here"):
        cp.pooling_inputs("second", [items[0], image])
    with pytest.raises(InvalidArgument, match=r"^first\[0\]: set one of text"):
        cp.pooling_inputs("first", [common_pb2.Input()])


def test_embed_options_defaults_and_checks() -> None:
    options = cp.embed_options(pooling_pb2.EmbedRequest())
    assert options == cp.EmbedOptions(normalize=True, dimensions=None, truncate="none", packed=None)
    options = cp.embed_options(
        pooling_pb2.EmbedRequest(
            normalize=False,
            dimensions=8,
            truncate=common_pb2.TRUNCATE_LEFT,
            encoding=pooling_pb2.ENCODING_FP16_BYTES,
        )
    )
    assert options == cp.EmbedOptions(False, 8, "left", "<f2")
    with pytest.raises(InvalidArgument, match="^dimensions: must be >= 1"):
        cp.embed_options(pooling_pb2.EmbedRequest(dimensions=0))
    with pytest.raises(InvalidArgument, match="^encoding: unknown value 5"):
        cp.embed_options(pooling_pb2.EmbedRequest(encoding=5))  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("encoding", "dtype"),
    [
        (pooling_pb2.ENCODING_UNSPECIFIED, None),
        (pooling_pb2.ENCODING_FLOAT, None),
        (pooling_pb2.ENCODING_FP32_BYTES, "<f4"),
        (pooling_pb2.ENCODING_FP16_BYTES, "<f2"),
    ],
)
def test_embeddings_as_floats_or_packed_little_endian(encoding: int, dtype: str | None) -> None:
    vectors = torch.randn(3, 5, generator=torch.Generator().manual_seed(0))
    request = pooling_pb2.EmbedRequest(encoding=encoding)  # type: ignore[arg-type]
    options = cp.embed_options(request)
    reply = cp.embed_response(EmbedResult(vectors, 12), options, "r", "m", TIMING)
    assert (reply.request_id, reply.model, reply.usage.prompt_tokens) == ("r", "m", 12)
    assert reply.timing == TIMING and len(reply.embeddings) == 3
    for row, e in zip(vectors.numpy(), reply.embeddings, strict=True):
        if dtype is None:
            assert not e.packed
            np.testing.assert_array_equal(np.asarray(e.values, np.float32), row)
        else:
            assert not e.values and len(e.packed) == 5 * np.dtype(dtype).itemsize
            np.testing.assert_array_equal(np.frombuffer(e.packed, dtype), row.astype(dtype))


@pytest.mark.parametrize("dim", [1, 5, 31, 32, 768, 4096])  # lengths of 1, 2 and 3 varint bytes
def test_float_values_are_the_message_set_value_by_value(dim: int) -> None:
    """ENCODING_FLOAT's values, parsed from the rows' bytes, are the Embedding that setting each
    value builds, bit for bit (-0.0, infinities, NaN and subnormals too)."""
    vectors = torch.randn(4, dim, generator=torch.Generator().manual_seed(dim))
    vectors[0, 0], vectors[1, 0], vectors[2, 0], vectors[3, 0] = -0.0, float("inf"), float("nan"), 1e-40
    got = cp.embeddings(vectors, None)
    want = [pooling_pb2.Embedding(values=row) for row in vectors.numpy().tolist()]
    assert [g.SerializeToString() for g in got] == [w.SerializeToString() for w in want]
    for g, row in zip(got, vectors.numpy(), strict=True):
        assert np.asarray(g.values, np.float32).tobytes() == row.tobytes() and not g.packed
    assert cp.embeddings(torch.empty(0, dim), None) == []


def test_rerank_classify_and_score_responses() -> None:
    ranked = RerankResult([RankedDocument(2, 0.9, "c"), RankedDocument(0, 0.1, "a")], 30)
    reply = cp.rerank_response(ranked, False, "r", "m", TIMING)
    assert [(r.index, r.document) for r in reply.results] == [(2, ""), (0, "")]
    assert reply.results[0].score == pytest.approx(0.9) and reply.usage.prompt_tokens == 30
    reply = cp.rerank_response(ranked, True, "r", "m", TIMING)
    assert [r.document for r in reply.results] == ["c", "a"]
    scores = [LabelScore("pos", 0.7), LabelScore("neg", 0.3)]
    classified = cp.classify_response(
        ClassifyResult([Classification("pos", scores)], 4), "r", "m", TIMING
    )
    (result,) = classified.results
    assert result.label == "pos" and [s.label for s in result.scores] == ["pos", "neg"]
    assert classified.usage.prompt_tokens == 4 and classified.model == "m"
    scored = cp.score_response(ScoreResult([0.5, -0.25], 9), "r", "m", TIMING)
    assert list(scored.scores) == [0.5, -0.25] and scored.usage.prompt_tokens == 9


def test_model_info_reports_pooling_facts() -> None:
    facts = ModelFacts(
        "BertForSequenceClassification",
        512,
        "float32",
        "cpu",
        30522,
        score_method="cross-encoder",
        labels=("no", "yes"),
    )
    handle = ModelHandle(
        "ce", frozenset({Task.SCORE, Task.CLASSIFY, Task.RERANK}), None, None, facts
    )
    info = model_info(handle)
    assert list(info.tasks) == [
        models_pb2.TASK_RERANK,
        models_pb2.TASK_CLASSIFY,
        models_pb2.TASK_SCORE,
    ]
    assert info.score_method == models_pb2.SCORE_METHOD_CROSS_ENCODER
    assert list(info.labels) == ["no", "yes"] and info.embedding_dimension == 0
    embedder = ModelFacts(
        "BertModel", 512, "float32", "cpu", 30522, score_method="cosine", embedding_dimension=384
    )
    info = model_info(ModelHandle("e", frozenset({Task.EMBED}), None, None, embedder))
    assert info.score_method == models_pb2.SCORE_METHOD_COSINE and info.embedding_dimension == 384
    plain = ModelFacts("LlamaForCausalLM", 512, "float32", "cpu", 100)
    info = model_info(ModelHandle("g", frozenset({Task.GENERATE}), None, None, plain))
    assert info.score_method == models_pb2.SCORE_METHOD_UNSPECIFIED
