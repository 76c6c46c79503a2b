"""Fuzzing every RPC of mmserve.v1.Inference: random messages built from the descriptors
(tests/server/proto_strategies.py), with unknown fields appended, and raw or mutated bytes.
Every answer is OK, INVALID_ARGUMENT, RESOURCE_EXHAUSTED or OUT_OF_RANGE, and never shows a
traceback or a server path; afterwards health says SERVING, nothing was logged at ERROR,
and a greedy Generate and an Embed give exactly what they gave before.

A few hundred examples in all by default; MMSERVE_FUZZ_EXAMPLES=N runs N per test. With -s,
each test prints its answers by method and code: the fuzzing should reach past validation."""

from __future__ import annotations

import logging
import os
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.protobuf.descriptor import MethodDescriptor
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import mmserve
from mmserve.server.config import ModelSpec
from mmserve_client.v1 import common_pb2, generate_pb2, pooling_pb2
from tests.pooling.tiny_pooling_models import make_tiny_xlm_roberta
from tests.server.conftest import ServerThread, serve
from tests.server.proto_strategies import (
    LONG_TEXT,
    TEXT,
    integers,
    messages,
    mostly,
    unknown_fields,
)
from tests.server.raw_rpc import HEALTH_CHECK, INFERENCE, Outcome, call_raw, path

EXAMPLES = int(os.environ.get("MMSERVE_FUZZ_EXAMPLES", "0"))  # test-only: more examples
MESSAGE_LIMIT = 256 * 1024
Code = grpc.StatusCode
ALLOWED = {Code.OK, Code.INVALID_ARGUMENT, Code.RESOURCE_EXHAUSTED, Code.OUT_OF_RANGE}
HEALTH_NOT_FOUND = Code.NOT_FOUND  # Health/Check of an unknown service, as the protocol says
MODELS = ("gen", "ce")  # gen: generate and embed; ce: a cross-encoder (rerank, score, classify)
# the model that serves each pooling/generate method (the others: either)
SERVING = {"Generate": "gen", "Embed": "gen", "Rerank": "ce", "Score": "ce", "Classify": "ce"}
_ANY_U32 = integers(0, 2**32 - 1)  # mostly 0..8, and edges
_SP, _SO = "mmserve.v1.SamplingParams", "mmserve.v1.StructuredOutput"


def _usually(*plausible: Any, hostile: st.SearchStrategy[Any] = TEXT) -> st.SearchStrategy[Any]:
    return mostly(st.sampled_from(plausible), hostile)


# Values that pass validation more often than random ones, so that the fuzzing reaches the
# engine, the templates and the grammar compilers; each still takes hostile values too.
OVERRIDES: dict[str, st.SearchStrategy[Any]] = {
    "mmserve.v1.TokenIds.ids": mostly(st.integers(0, 400), _ANY_U32),
    f"{_SP}.n": mostly(st.integers(1, 2), _ANY_U32),
    f"{_SP}.max_tokens": mostly(st.integers(1, 8), _ANY_U32),  # short streams, mostly
    **{f"{_SP}.{name}": _ANY_U32 for name in ("min_tokens", "logprobs", "prompt_logprobs")},
    f"{_SP}.top_p": mostly(st.floats(0.125, 1.0, width=32), st.floats(width=32)),
    "mmserve.v1.Tool.name": _usually("get_weather", "f"),
    "mmserve.v1.Tool.parameters_json": _usually(
        '{"type": "object", "properties": {"city": {"type": "string"}}}', "{}"
    ),
    f"{_SO}.json_schema": _usually('{"type": "object"}', '{"type": "string", "maxLength": 3}'),
    f"{_SO}.regex": _usually("[a-z]{1,4}", "yes|no", r"\d+"),
    f"{_SO}.grammar": _usually('root ::= "a" | "b"', "root ::= [0-9]+"),
    f"{_SO}.json_object": mostly(st.just(True), st.just(False)),
}


def examples(default: int) -> int:
    return EXAMPLES or default


@dataclass(frozen=True)
class Canary:
    tokens: tuple[int, ...]
    vector: tuple[float, ...]


@pytest.fixture(scope="module")
def folders(tiny_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    ce = make_tiny_xlm_roberta(tmp_path_factory.mktemp("fuzz") / "ce", num_labels=1)
    return [tiny_models["tiny-a"], ce]


@pytest.fixture(scope="module")
def server(folders: list[Path]) -> Iterator[ServerThread]:
    """Tight limits, so that random requests run into them, and short streams."""
    server = serve(
        [ModelSpec(name, str(folder)) for name, folder in zip(MODELS, folders, strict=True)],
        max_tokens=16,
        max_n=4,
        max_prompt_tokens=64,
        max_message_bytes=MESSAGE_LIMIT,
        max_images_per_request=2,
    )
    yield server
    server.stop()


@pytest.fixture(scope="module")
def channel(server: ServerThread) -> Iterator[grpc.Channel]:
    options = [("grpc.max_receive_message_length", 64 * 1024 * 1024)]
    with grpc.insecure_channel(server.target, options=options) as channel:
        yield channel


def _canary(channel: grpc.Channel) -> Canary:
    params = generate_pb2.SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    request = generate_pb2.GenerateRequest(model="gen", prompt="The quick brown fox", params=params)
    stream = channel.unary_stream(
        path(INFERENCE.methods_by_name["Generate"]),
        request_serializer=generate_pb2.GenerateRequest.SerializeToString,
        response_deserializer=generate_pb2.GenerateResponse.FromString,
    )
    tokens = tuple(t for chunk in stream(request, timeout=60) for t in chunk.token_ids)
    embed = channel.unary_unary(
        path(INFERENCE.methods_by_name["Embed"]),
        request_serializer=pooling_pb2.EmbedRequest.SerializeToString,
        response_deserializer=pooling_pb2.EmbedResponse.FromString,
    )
    texts = [common_pb2.Input(text="A cat sits on the mat.")]
    reply = embed(pooling_pb2.EmbedRequest(model="gen", inputs=texts), timeout=60)
    assert len(tokens) == 8 and reply.embeddings[0].values
    return Canary(tokens, tuple(reply.embeddings[0].values))


@pytest.fixture(scope="module")
def canary(channel: grpc.Channel) -> Canary:
    return _canary(channel)


def _secrets(folders: list[Path]) -> list[str]:
    """Server-side paths no answer may show: the model folders and the installed code."""
    return [*(str(f) for f in folders), str(Path(mmserve.__file__).parent)]


def check(outcome: Outcome, method: MethodDescriptor, secrets: list[str]) -> None:
    allowed = outcome.code in ALLOWED or (
        outcome.code == HEALTH_NOT_FOUND and method is HEALTH_CHECK
    )
    assert allowed, (path(method), outcome)
    # grpc's words for a handler's uncaught exception ("Unexpected <class 'KeyError'>: ..."),
    # not a grammar's own "Unexpected character" in an INVALID_ARGUMENT
    assert "Traceback" not in outcome.details and "Unexpected <class" not in outcome.details
    # the client's own verdict on trailers past its metadata limit, not the server's answer
    assert not outcome.details.startswith("Stream removed"), outcome
    assert not any(s in outcome.details for s in secrets), outcome.details


def assert_intact(channel: grpc.Channel, canary: Canary, caplog: pytest.LogCaptureFixture) -> None:
    health = health_pb2_grpc.HealthStub(channel)
    reply = health.Check(health_pb2.HealthCheckRequest(), timeout=10)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING
    assert _canary(channel) == canary
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]
    assert not errors, [r.getMessage() for r in errors]


def _requests(method: MethodDescriptor) -> st.SearchStrategy[Any]:
    """Random requests of the method, mostly for a model that serves it."""
    serving = st.sampled_from([SERVING[method.name]] if method.name in SERVING else MODELS)
    other = st.one_of(st.sampled_from(["", *MODELS]), st.text(max_size=8), LONG_TEXT)
    model = mostly(serving, other)
    overrides = {**OVERRIDES, "model": model}
    return messages(method.input_type, overrides, required=frozenset({"model"}))


def _request_bytes(method: MethodDescriptor) -> st.SearchStrategy[bytes]:
    """A random request of the method, serialized, sometimes with unknown fields after it."""
    request = _requests(method)
    extra = mostly(st.just(b""), unknown_fields(method.input_type))
    return st.tuples(request.map(lambda m: m.SerializeToString()), extra).map(b"".join)


CALLS = st.sampled_from(list(INFERENCE.methods)).flatmap(
    lambda m: st.tuples(st.just(m), _request_bytes(m))
)


def fuzz_settings(default_examples: int) -> settings:
    return settings(
        max_examples=examples(default_examples),
        deadline=None,  # a call takes what the server takes; a hang fails on the call's timeout
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )


def fuzz(
    channel: grpc.Channel,
    calls: st.SearchStrategy[tuple[MethodDescriptor, bytes]],
    default_examples: int,
    secrets: list[str],
) -> Counter[str]:
    """Sends every call hypothesis draws and checks its answer; counts the answers by method
    and code."""
    answers: Counter[str] = Counter()

    @fuzz_settings(default_examples)
    @given(call=calls)
    def run(call: tuple[MethodDescriptor, bytes]) -> None:
        method, payload = call
        outcome = call_raw(channel, method, payload, timeout=60)
        check(outcome, method, secrets)
        answers[f"{method.name} {outcome.code.name}"] += 1

    run()
    print(sorted(answers.items()))
    return answers


def test_random_messages_on_every_method(
    channel: grpc.Channel, canary: Canary, folders: list[Path], caplog: pytest.LogCaptureFixture
) -> None:
    fuzz(channel, CALLS, 300, _secrets(folders))
    assert_intact(channel, canary, caplog)


def _mutated(method: MethodDescriptor) -> st.SearchStrategy[bytes]:
    """A valid request with bytes overwritten or cut: bad lengths, tags and UTF-8."""

    def mutate(data: bytes, at: list[tuple[int, int]], cut: int | None) -> bytes:
        out = bytearray(data)
        for index, byte in at:
            if out:
                out[index % len(out)] = byte
        return bytes(out[:cut])

    valid = _requests(method).map(lambda m: m.SerializeToString())
    edits = st.lists(st.tuples(st.integers(0, 2**16), st.integers(0, 255)), max_size=4)
    return st.builds(mutate, valid, edits, st.one_of(st.none(), st.integers(0, 64)))


RAW_CALLS = st.sampled_from([*INFERENCE.methods, HEALTH_CHECK]).flatmap(
    lambda m: st.tuples(st.just(m), st.one_of(st.binary(max_size=256), _mutated(m)))
)


def test_raw_and_mutated_bytes_on_every_method(
    channel: grpc.Channel, canary: Canary, folders: list[Path], caplog: pytest.LogCaptureFixture
) -> None:
    fuzz(channel, RAW_CALLS, 200, _secrets(folders))
    assert_intact(channel, canary, caplog)
