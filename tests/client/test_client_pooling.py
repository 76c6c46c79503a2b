"""Embed, rerank, classify, score, tokenize and list_models through the sync Client."""

from __future__ import annotations

import grpc
import pytest
from fake_inference import POOLING_MODEL, POOLING_TOTAL_MS, VECTOR, FakeInference

from mmserve_client import (
    Client,
    Image,
    MMServeError,
    RerankResult,
    ResultList,
    Timing,
    Usage,
    _responses,
)
from mmserve_client.v1 import common_pb2


@pytest.mark.parametrize("encoding", ["fp32", "fp16", "float"])
@pytest.mark.parametrize("numpy", [True, False])
def test_embed_decodes_every_encoding(
    client: Client, encoding: str, numpy: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    if numpy:
        np = pytest.importorskip("numpy")
    else:
        monkeypatch.setattr(_responses, "np", None)
    vecs = client.embed(["abc", "abcd"], encoding=encoding)  # type: ignore[arg-type]
    assert len(vecs) == 2
    if numpy:
        assert isinstance(vecs[0], np.ndarray) and vecs[0].dtype == np.float32
    else:
        assert isinstance(vecs[0], list)
    assert list(vecs[0]) == pytest.approx(VECTOR)
    assert vecs[1][0] == pytest.approx(4.0)


def test_embed_options_and_inputs(client: Client, fake: FakeInference) -> None:
    client.embed([[97, 98], b"\x89PNG", Image(uuid="img-1")], truncate="left", dimensions=2)
    sent = fake.requests[-1]
    kinds = [i.WhichOneof("kind") for i in sent.inputs]
    assert kinds == ["token_ids", "image", "image"]
    assert sent.inputs[2].image.uuid == "img-1" and not sent.inputs[2].image.HasField("data")
    assert sent.dimensions == 2 and not sent.HasField("normalize")
    assert sent.truncate == common_pb2.TRUNCATE_LEFT
    client.embed("one string is one input", normalize=False)
    assert fake.requests[-1].HasField("normalize") and len(fake.requests[-1].inputs) == 1


def test_rerank(client: Client) -> None:
    docs = ["cats purr", "dogs bark loud", "loud cats"]
    ranked = client.rerank("loud cats", docs, top_n=2, return_documents=True)
    assert ranked == [RerankResult(2, 1.0, "loud cats"), RerankResult(0, 0.5, "cats purr")]
    assert client.rerank("loud", docs)[0].document is None
    with pytest.raises(TypeError):
        client.rerank("q", "not a list")


def test_classify_and_score(client: Client) -> None:
    first, second = client.classify(["tiny", "much longer"])
    assert (first.label, second.label) == ("short", "long")
    assert [s.label for s in second.scores] == ["long", "short"]
    assert client.score("q", ["q", "d"]) == [1.0, 0.0]
    assert client.score(["a", "b"], ["a", "c"]) == [1.0, 0.0]  # pairwise


def test_results_carry_usage_timing_model_and_request_id(client: Client) -> None:
    """The response fields beside the results reach the caller: each pooling call's list
    carries them, and still equals the plain list of results."""
    calls = [
        (client.embed(["abc", "de"], request_id="r-embed"), 5),
        (client.rerank("a b", ["a", "c"], request_id="r-rerank"), 5),
        (client.classify(["tiny"], request_id="r-classify"), 4),
        (client.score("q", ["q", "d"], request_id="r-score"), 4),
    ]
    for results, prompt_tokens in calls:
        assert isinstance(results, ResultList) and isinstance(results, list)
        assert results.usage == Usage(prompt_tokens=prompt_tokens)
        assert results.timing == Timing(total_ms=POOLING_TOTAL_MS)
        assert results.model == POOLING_MODEL
        assert results.request_id.startswith("r-")
    assert client.score("q", ["q", "d"]) == [1.0, 0.0]
    assert client.score("q", ["q"]).request_id == "pool-1"  # the server's, when none is sent
    tokens = client.tokenize("hi", request_id="r-tok")
    assert (tokens.model, tokens.request_id) == ("fake-model", "r-tok")
    assert client.list_models(request_id="r-list").request_id == "r-list"


def test_tokenize_detokenize_list_models(client: Client, fake: FakeInference) -> None:
    t = client.tokenize("hi", return_tokens=True)
    assert (t.token_ids, t.tokens, t.max_context) == ((104, 105), ("h", "i"), 2048)
    chat = client.tokenize([{"role": "user", "content": "yo"}], add_generation_prompt=False)
    assert chat.token_ids == (121, 111)
    assert fake.requests[-1].chat.add_generation_prompt is False
    assert client.detokenize([104, 105]) == "hi"
    (m,) = client.list_models()
    assert (m.name, m.tasks, m.score_method) == ("fake-model", ("generate", "score"), "yes_token")


def test_pooling_errors(client: Client) -> None:
    with pytest.raises(MMServeError) as e:
        client.embed(["fail:INVALID_ARGUMENT"])
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
