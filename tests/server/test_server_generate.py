"""End to end on tiny random models: routing, streaming, n > 1, logprobs, tokenize, list
models, health and reflection, through the SDK and raw stubs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)

from mmserve import LLM, SamplingParams
from mmserve.server.config import ServerConfig
from mmserve.server.grpc_server import MMServer
from mmserve_client import Client, MMServeError
from mmserve_client.v1 import common_pb2, generate_pb2, models_pb2
from tests.server.conftest import ServerThread

PROMPT = "Hello world, this is a test."


@pytest.fixture
def client(tiny_server: ServerThread) -> Any:
    with Client(tiny_server.target, timeout=60) as c:
        yield c


def test_list_models(client: Client) -> None:
    models = {m.name: m for m in client.list_models()}
    assert list(models) == ["tiny-a", "tiny-b"]
    a = models["tiny-a"]
    assert a.tasks == ("generate", "embed")  # a decoder embeds too (last-token pooling)
    assert (a.score_method, a.labels, a.embedding_dimension) == (None, (), 64)
    assert (a.max_context, a.vocab_size, a.device, a.dtype) == (1024, 368, "cpu", "float32")
    assert a.architecture == "LlamaForCausalLM"
    assert models["tiny-b"].max_context == 256
    assert [m.name for m in client.list_models(model="tiny-b")] == ["tiny-b"]
    with pytest.raises(MMServeError) as e:
        client.list_models(model="nope")
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and "model" in e.value.message


def test_routing_matches_offline_api(client: Client, tiny_models: dict[str, Path]) -> None:
    outputs = {}
    for name, path in tiny_models.items():
        offline = LLM(str(path), device="cpu", block_size=4, num_kv_blocks=128)
        expected = offline.generate(PROMPT, SamplingParams(max_tokens=12, temperature=0))[0]
        got = client.generate(PROMPT, model=name, max_tokens=12, temperature=0)
        assert got.token_ids == tuple(expected.outputs[0].token_ids)
        assert got.text == expected.outputs[0].text
        assert got.model == name and got.usage is not None
        assert got.usage.prompt_tokens == len(expected.prompt_token_ids)
        outputs[name] = got.token_ids
    assert outputs["tiny-a"] != outputs["tiny-b"]  # really two models
    with pytest.raises(MMServeError) as e:  # two models can generate: `model` is required
        client.generate(PROMPT, max_tokens=2)
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "model" in e.value.message and "tiny-a" in e.value.message


def test_stream_concatenates_to_the_unary_result(client: Client) -> None:
    kw: dict[str, Any] = {"model": "tiny-a", "max_tokens": 20, "temperature": 0}
    whole = client.generate(PROMPT, **kw)
    chunks = list(client.generate_stream(PROMPT, request_id="my-id", **kw))
    assert "".join(c.text for c in chunks) == whole.text
    assert sum((c.token_ids for c in chunks), ()) == whole.token_ids
    assert all(c.request_id == "my-id" for c in chunks)
    assert chunks[0].model == "tiny-a" and all(c.model == "" for c in chunks[1:])
    assert [c.finish_reason for c in chunks[:-1]] == [None] * (len(chunks) - 1)
    last = chunks[-1]
    assert last.finish_reason == "length" and last.usage is not None and last.timing is not None
    assert last.usage.completion_tokens == 20
    assert 0 <= last.timing.queue_ms <= last.timing.first_token_ms <= last.timing.total_ms
    assert all(c.usage is None and c.timing is None for c in chunks[:-1])


def test_n_choices_interleaved_by_index(client: Client) -> None:
    kw: dict[str, Any] = {"model": "tiny-a", "max_tokens": 6, "temperature": 1.0, "seed": 7, "n": 3}
    chunks = list(client.generate_stream(PROMPT, **kw))
    assert {c.index for c in chunks} == {0, 1, 2}
    finished = [c.index for c in chunks if c.finish_reason is not None]
    assert sorted(finished) == [0, 1, 2]
    for i in range(3):
        mine = [c for c in chunks if c.index == i]
        assert mine[-1].finish_reason is not None and mine[-1].usage is not None
        assert mine[-1].usage.completion_tokens == sum(len(c.token_ids) for c in mine) == 6
    again = client.generate(PROMPT, **kw)  # seeded: the same choices again
    assert [r.token_ids for r in again] == [
        sum((c.token_ids for c in chunks if c.index == i), ()) for i in range(3)
    ]


def test_logprobs_and_stop_token(client: Client) -> None:
    ids = client.tokenize(PROMPT, model="tiny-a").token_ids
    r = client.generate(
        PROMPT, model="tiny-a", max_tokens=5, temperature=0, logprobs=2, prompt_logprobs=1
    )
    assert [lp.token_id for lp in r.logprobs] == list(r.token_ids)
    assert all(len(lp.top) == 2 and lp.top[0].logprob >= lp.top[1].logprob for lp in r.logprobs)
    assert [lp.token_id for lp in r.prompt_logprobs] == list(ids[1:])
    stop_id = r.token_ids[2]
    first = r.token_ids.index(stop_id)
    s = client.generate(
        PROMPT, model="tiny-a", max_tokens=5, temperature=0, stop_token_ids=[stop_id]
    )
    assert s.finish_reason == "stop" and s.stop == stop_id
    assert s.token_ids == r.token_ids[: first + 1]
    # the stop token's text is left out unless asked for (vLLM)
    before = client.detokenize(r.token_ids[:first], skip_special_tokens=True, model="tiny-a")
    assert s.text == before
    kw = {"model": "tiny-a", "max_tokens": 5, "temperature": 0, "stop_token_ids": [stop_id]}
    with_stop = client.generate(PROMPT, include_stop_str_in_output=True, **kw)
    upto = client.detokenize(r.token_ids[: first + 1], skip_special_tokens=True, model="tiny-a")
    assert with_stop.text == upto and upto != before


def test_tokenize_detokenize_and_chat(client: Client) -> None:
    tok = client.tokenize(PROMPT, model="tiny-b", return_tokens=True, request_id="t-1")
    assert len(tok.tokens) == len(tok.token_ids) and tok.max_context == 256
    assert (tok.model, tok.request_id) == ("tiny-b", "t-1")
    assert client.detokenize(list(tok.token_ids), model="tiny-b") == PROMPT
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    chat_ids = client.tokenize(messages, model="tiny-b").token_ids
    r = client.chat(messages, model="tiny-b", max_tokens=3, temperature=0)
    assert r.usage is not None and r.usage.prompt_tokens == len(chat_ids)
    same = client.generate(list(chat_ids), model="tiny-b", max_tokens=3, temperature=0)
    assert same.token_ids == r.token_ids  # chat = its template's token ids
    with pytest.raises(MMServeError) as e:
        client.detokenize([100_000], model="tiny-b")
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and "token_ids" in e.value.message


def test_sdk_keeps_the_details_of_pooling_responses(client: Client) -> None:
    """Usage, timing, model and request id of an Embed reach the SDK's caller."""
    vectors = client.embed([PROMPT, "Hi"], model="tiny-a", request_id="e-1")
    ids = [client.tokenize(t, model="tiny-a").token_ids for t in (PROMPT, "Hi")]
    assert vectors.usage is not None and vectors.usage.prompt_tokens == sum(map(len, ids))
    assert vectors.timing is not None and vectors.timing.total_ms > 0
    assert (vectors.model, vectors.request_id) == ("tiny-a", "e-1")


def test_health_per_model_and_overall(tiny_server: ServerThread) -> None:
    with grpc.insecure_channel(tiny_server.target) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", "mmserve.v1.Inference", "tiny-a", "tiny-b"):
            reply = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING, service
        with pytest.raises(grpc.RpcError) as e:
            health.Check(health_pb2.HealthCheckRequest(service="nope"), timeout=10)
        assert e.value.code() == grpc.StatusCode.NOT_FOUND


def test_reflection_lists_the_services(tiny_server: ServerThread) -> None:
    with grpc.insecure_channel(tiny_server.target) as channel:
        db = ProtoReflectionDescriptorDatabase(channel)
        services = db.get_services()
        assert "mmserve.v1.Inference" in services and "grpc.health.v1.Health" in services
        method = db.FindFileContainingSymbol("mmserve.v1.Inference")
        assert "mmserve/v1/inference.proto" == method.name


def hf_greedy(path: Path, prompt: list[int], max_tokens: int) -> list[int]:
    """transformers' greedy tokens on the same weights: the reference."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        ids = model.generate(torch.tensor([prompt]), max_new_tokens=max_tokens, do_sample=False)
    return ids[0, len(prompt) :].tolist()


def test_raw_stub_request(stub: Any, tiny_models: dict[str, Path]) -> None:
    request = generate_pb2.GenerateRequest(
        model="tiny-a", token_ids=common_pb2.TokenIds(ids=[5, 6, 7])
    )
    request.params.max_tokens = 4
    request.params.temperature = 0
    chunks = list(stub.Generate(request, timeout=30))
    assert chunks[0].request_id and chunks[-1].finish_reason == generate_pb2.FINISH_REASON_LENGTH
    tokens = [t for c in chunks for t in c.token_ids]
    assert tokens == hf_greedy(tiny_models["tiny-a"], [5, 6, 7], 4)
    listing = stub.ListModels(models_pb2.ListModelsRequest(request_id="r1"), timeout=10)
    assert listing.request_id == "r1"
    assert list(listing.models[0].tasks) == [models_pb2.TASK_GENERATE, models_pb2.TASK_EMBED]


def test_a_port_in_use_is_an_error(tiny_server: ServerThread) -> None:
    second = MMServer(tiny_server.registry, ServerConfig(port=tiny_server.port))
    with pytest.raises(OSError, match="cannot listen"):
        tiny_server.run(second.start())


@pytest.mark.parametrize("constraint", [{"choice": ["yes"]}, {"regex": "[0-9]{2}"}])
def test_min_tokens_never_breaks_a_completed_constraint(
    client: Client, constraint: dict[str, Any]
) -> None:
    """Once the output matches its constraint, the grammar allows only EOS, which min_tokens
    holds back: the choice ends there (the output must match), instead of drawing tokens from
    a row with nothing allowed (-inf logprobs, ids outside the grammar)."""
    kw: dict[str, Any] = {"model": "tiny-a", "max_tokens": 12, "temperature": 0, **constraint}
    free = client.generate(PROMPT, skip_special_tokens=False, **kw)
    assert free.finish_reason == "stop" and len(free.token_ids) < 8
    r = client.generate(PROMPT, min_tokens=8, skip_special_tokens=False, logprobs=1, **kw)
    assert r.finish_reason == "stop" and r.text == free.text.removesuffix("<|im_end|>")
    assert r.token_ids == free.token_ids[: len(r.token_ids)]
    assert all(lp.logprob > float("-inf") for lp in r.logprobs)
    assert r.usage is not None and r.usage.completion_tokens == len(r.token_ids)


def test_a_grammar_that_allows_nothing_is_refused(client: Client) -> None:
    """A grammar whose start state allows no token, not even EOS, has no output to give:
    INVALID_ARGUMENT naming it (it ran to max_tokens on tokens outside it), then served."""
    for grammar in ["root ::= root", "root ::= a\na ::= root"]:
        with pytest.raises(MMServeError) as e:
            client.generate(PROMPT, model="tiny-a", max_tokens=4, grammar=grammar)
        assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert e.value.message.startswith("structured.grammar: allows no output")
    r = client.generate(PROMPT, model="tiny-a", max_tokens=4, grammar='root ::= "a" root | ""')
    assert r.finish_reason in ("stop", "length") and set(r.text) <= {"a"}
