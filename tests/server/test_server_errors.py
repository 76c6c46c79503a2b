"""API.md's error table, end to end: each bad input gets its code and a message naming the
field, and the server then serves the next request; cancelled and expired calls are aborted
in the engine while a concurrent stream finishes untouched."""

from __future__ import annotations

import time
from typing import Any

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from mmserve_client import Client, MMServeError
from mmserve_client.v1 import common_pb2, generate_pb2, models_pb2, pooling_pb2
from tests.server.conftest import ServerThread, wait_all_blocks_free

INVALID = grpc.StatusCode.INVALID_ARGUMENT
UNIMPLEMENTED = grpc.StatusCode.UNIMPLEMENTED


def _request(**fields: Any) -> generate_pb2.GenerateRequest:
    """A GenerateRequest for tiny-b; params.* keys set SamplingParams fields."""
    params = {k[len("params.") :]: v for k, v in fields.items() if k.startswith("params.")}
    rest = {k: v for k, v in fields.items() if not k.startswith("params.")}
    req = generate_pb2.GenerateRequest(**{"model": "tiny-b", **rest})
    if "prompt" not in rest and "chat" not in rest and "token_ids" not in rest:
        req.prompt = "Hello"
    for key, value in params.items():
        if key == "logit_bias":
            req.params.logit_bias.update(value)
        elif isinstance(value, list):
            getattr(req.params, key).extend(value)
        else:
            setattr(req.params, key, value)
    return req


def _chat(*parts: generate_pb2.ContentPart, role: str = "user", **chat: Any) -> generate_pb2.Chat:
    parts = parts or (generate_pb2.ContentPart(text="hi"),)
    return generate_pb2.Chat(messages=[generate_pb2.Message(role=role, content=parts)], **chat)


IMAGE = generate_pb2.ContentPart(image=common_pb2.Image(data=b"\x89PNG"))
BAD_TOOL = generate_pb2.Tool(name="f", parameters_json="{not json")

# (request, expected code, text the message must contain: the field)
CASES = [
    (_request(**{"params.temperature": -1.0}), INVALID, "params.temperature"),
    (_request(**{"params.temperature": float("inf")}), INVALID, "params.temperature: must be a finite"),
    (_request(**{"params.min_tokens": 9, "params.max_tokens": 4}), INVALID, "params.min_tokens: 9 exceeds max_tokens (4"),
    (_request(**{"params.top_p": 1.5}), INVALID, "params.top_p"),
    (_request(**{"params.n": 0}), INVALID, "params.n"),
    (_request(**{"params.n": 17}), INVALID, "params.n"),
    (_request(**{"params.max_tokens": 0}), INVALID, "params.max_tokens"),
    (_request(**{"params.max_tokens": 5000}), INVALID, "params.max_tokens"),
    (_request(**{"params.max_tokens": 256}), INVALID, "params.max_tokens"),  # past the context
    (_request(**{"params.logprobs": 21}), INVALID, "params.logprobs"),
    (_request(**{"params.logit_bias": {1: 500.0}}), INVALID, "params.logit_bias"),
    (_request(**{"params.stop_token_ids": [10**6]}), INVALID, "params.stop_token_ids"),
    (_request(**{"params.seed": 2**64 - 1}), INVALID, "params.seed"),
    (_request(**{"params.min_p": 2.0}), INVALID, "params.min_p"),
    (_request(**{"params.allowed_token_ids": [1, 10**6]}), INVALID, "params.allowed_token_ids: token id 1000000"),
    (_request(**{"params.allowed_token_ids": [1] * (2**17 + 1)}), INVALID, "params.allowed_token_ids: 131073 ids"),
    (_request(**{"params.bad_words": ["x"] * 129}), INVALID, "params.bad_words: 129 words"),
    (_request(**{"params.bad_words": ["ok", " "]}), INVALID, "params.bad_words[1]"),
    (_request(**{"params.bad_words": ["x" * 1025]}), INVALID, "params.bad_words[0]: 1025 characters"),
    (_request(**{"params.truncate_prompt_tokens": 0}), INVALID, "params.truncate_prompt_tokens"),
    (_request(model="nope"), INVALID, "model"),
    (generate_pb2.GenerateRequest(model="tiny-b"), INVALID, "input"),
    (_request(prompt=""), INVALID, "prompt"),
    (_request(token_ids=common_pb2.TokenIds(ids=[1, 10**6])), INVALID, "token_ids"),
    (_request(token_ids=common_pb2.TokenIds(ids=[5] * 300)), INVALID, "token_ids"),  # too long
    (_request(chat=_chat(IMAGE)), INVALID, "chat.messages[0].content[0].image"),
    (_request(chat=_chat(role="robot")), INVALID, "chat.messages[0].role"),
    (_request(chat=_chat(template_kwargs={"evil": "1"})), INVALID, "chat.template_kwargs"),
    (_request(chat=_chat(tools=[BAD_TOOL])), INVALID, "chat.tools[0].parameters_json"),
    (_request(chat=generate_pb2.Chat()), INVALID, "chat.messages"),
    (_request(structured=generate_pb2.StructuredOutput(json_schema="{")), INVALID, "structured"),
    (_request(structured=generate_pb2.StructuredOutput(regex="a(")), INVALID, "structured.regex"),
]


@pytest.mark.parametrize("request_, code, field", CASES, ids=[c[2] for c in CASES])
def test_bad_generate_input_then_next_request(
    stub: Any, request_: generate_pb2.GenerateRequest, code: grpc.StatusCode, field: str
) -> None:
    with pytest.raises(grpc.RpcError) as e:
        list(stub.Generate(request_, timeout=30))
    assert e.value.code() == code
    assert field in e.value.details()
    violation = field_violation(e.value)  # the field again, for clients not to parse messages
    assert e.value.details() == f"{violation.field}: {violation.description}"
    # (ignore_eos: the unseeded draw may end at EOS, depending on the draws before it)
    ok = list(stub.Generate(_request(**{"params.max_tokens": 2, "params.ignore_eos": True}), timeout=30))
    assert ok[-1].finish_reason == generate_pb2.FINISH_REASON_LENGTH


def field_violation(error: grpc.RpcError) -> error_details_pb2.BadRequest.FieldViolation:
    """The one field violation of an INVALID_ARGUMENT's google.rpc.BadRequest detail."""
    status = rpc_status.from_call(error)  # type: ignore[arg-type]
    assert status is not None, "no google.rpc.Status in the trailers"
    bad = error_details_pb2.BadRequest()
    assert [d.Unpack(bad) for d in status.details] == [True]
    (violation,) = bad.field_violations
    return violation


def test_the_sdk_names_the_bad_field(tiny_server: ServerThread) -> None:
    with Client(tiny_server.target, timeout=30) as c:
        with pytest.raises(MMServeError) as e:
            c.generate("Hello", model="tiny-b", temperature=-1.0)
        assert (e.value.field, e.value.retry_delay) == ("params.temperature", None)
        with pytest.raises(MMServeError) as e:
            c.chat([{"role": "robot", "content": "hi"}], model="tiny-b")
        assert e.value.field == "chat.messages[0].role"
        with pytest.raises(MMServeError) as e:
            c.embed("x", model="tiny-b", dimensions=0)
        assert e.value.field == "dimensions"


@pytest.mark.parametrize("name", ["x" * 10_000, "é" * 3000])
def test_long_values_quoted_in_messages_keep_the_code(stub: Any, name: str) -> None:
    """A status past the client's 8 KiB metadata limit arrives as RESOURCE_EXHAUSTED "Stream
    removed": messages quoting a long value are cut (the start names the field)."""
    for call, request in [
        (stub.ListModels, models_pb2.ListModelsRequest(model=name)),
        (stub.Embed, pooling_pb2.EmbedRequest(model=name, inputs=[common_pb2.Input(text="x")])),
    ]:
        with pytest.raises(grpc.RpcError) as e:
            call(request, timeout=10)
        assert e.value.code() == INVALID, e.value.details()
        details = e.value.details()
        assert details.startswith("model: unknown model") and details.endswith("bytes in all)")
        assert len(details.encode()) < 1100
        violation = field_violation(e.value)  # cut too: with the message, within the limit
        assert violation.field == "model" and len(violation.description.encode()) < 600


def test_pooling_routing_on_decoders(stub: Any) -> None:
    text = [common_pb2.Input(text="x")]
    with pytest.raises(grpc.RpcError) as e:  # both tiny decoders can embed: name one
        stub.Embed(pooling_pb2.EmbedRequest(inputs=text), timeout=10)
    assert e.value.code() == INVALID and e.value.details().startswith("model: ")
    with pytest.raises(grpc.RpcError) as e:
        stub.Classify(pooling_pb2.ClassifyRequest(model="tiny-b", inputs=text), timeout=10)
    assert e.value.code() == INVALID and "cannot classify" in e.value.details()
    ok = stub.Embed(pooling_pb2.EmbedRequest(model="tiny-b", inputs=text), timeout=30)
    assert len(ok.embeddings) == 1 and len(ok.embeddings[0].values) > 0
    assert ok.model == "tiny-b" and ok.usage.prompt_tokens >= 1


# (tiny-a's context is 1,024 tokens)
LONG: dict[str, Any] = {"model": "tiny-a", "max_tokens": 1000, "temperature": 0, "ignore_eos": True}
SHORT: dict[str, Any] = {"model": "tiny-a", "max_tokens": 400, "temperature": 0, "ignore_eos": True}
PROMPT = "The quick brown fox"


def test_cancel_and_deadline_abort_in_the_engine(tiny_server: ServerThread) -> None:
    handle = tiny_server.handle("tiny-a")
    with Client(tiny_server.target, timeout=120) as c:
        start = time.monotonic()
        alone = c.generate(PROMPT, **SHORT).token_ids
        # a deadline at half of 400 tokens' time passes while LONG's 1,000 are made, on a
        # machine of any speed (a fixed 0.5 s did not on a fast one)
        deadline = (time.monotonic() - start) / 2
        wait_all_blocks_free(handle)
        survivor = c.generate_stream(PROMPT, **SHORT)
        got = list(next(survivor).token_ids)
        # 1. cancelled mid-stream
        victim = c.generate_stream("Cancel me", **LONG)
        next(victim), next(victim)
        victim.close()
        # 2. deadline passes mid-stream
        with pytest.raises(MMServeError) as e:
            for _ in c.generate_stream("Too slow", **LONG, timeout=deadline):
                pass
        assert e.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
        for chunk in survivor:
            got += chunk.token_ids
        assert tuple(got) == alone
    wait_all_blocks_free(handle)
