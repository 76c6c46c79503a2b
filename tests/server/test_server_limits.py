"""Admission and limits on a server of their own: RESOURCE_EXHAUSTED with RetryInfo past
max_pending (health still answering), message size limits, and a dead engine (INTERNAL for
the request it failed, UNAVAILABLE for later ones, NOT_SERVING in health)."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_status import rpc_status

from mmserve.server.config import ModelSpec
from mmserve_client import Client, MMServeError
from mmserve_client.v1 import (
    common_pb2,
    generate_pb2,
    inference_pb2_grpc,
    pooling_pb2,
    tokenize_pb2,
)
from tests.server.conftest import ServerThread, serve, wait_all_blocks_free

MESSAGE_LIMIT = 16 * 1024


@pytest.fixture(scope="module")
def small_server(tiny_models: dict[str, Path]) -> Iterator[ServerThread]:
    """tiny-a alone, one call in flight at most, 16 KiB messages, 8-token prompts."""
    server = serve(
        [ModelSpec("tiny-a", str(tiny_models["tiny-a"]))],
        max_pending=1,
        max_message_bytes=MESSAGE_LIMIT,
        max_prompt_tokens=8,
        max_n=2,
    )
    yield server
    server.stop()


def _health(target: str, service: str = "") -> int:
    with grpc.insecure_channel(target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        return stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status


def test_past_max_pending_is_resource_exhausted_with_retry_info(small_server: ServerThread) -> None:
    with Client(small_server.target, timeout=60) as c:
        busy = c.generate_stream("Hello", max_tokens=500, temperature=0, ignore_eos=True)
        next(busy)
        with grpc.insecure_channel(small_server.target) as channel:
            stub = inference_pb2_grpc.InferenceStub(channel)
            with pytest.raises(grpc.RpcError) as e:
                stub.Tokenize(tokenize_pb2.TokenizeRequest(text="hi"), timeout=10)
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        status = rpc_status.from_call(e.value)
        assert status is not None and status.details
        info = error_details_pb2.RetryInfo()
        assert status.details[0].Unpack(info) and info.retry_delay.ToMilliseconds() > 0
        assert _health(small_server.target) == health_pb2.HealthCheckResponse.SERVING
        busy.close()
    wait_all_blocks_free(small_server.handle("tiny-a"))
    small_server.wait_idle()
    with Client(small_server.target, timeout=60) as c:  # the slot is free again
        assert c.generate("Hello", max_tokens=2).finish_reason == "length"


def test_message_size_limits(small_server: ServerThread) -> None:
    with Client(small_server.target, timeout=60) as c:
        with pytest.raises(MMServeError) as e:
            c.tokenize("x" * (2 * MESSAGE_LIMIT))
        assert e.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        with pytest.raises(MMServeError) as e:  # the reply would be too big
            c.tokenize("Hello world " * 1300, return_tokens=True)
        assert e.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert c.tokenize("fine").token_ids


def _too_large(call: Any) -> str:
    """Runs `call`, which must fail RESOURCE_EXHAUSTED for its reply's size without RetryInfo
    (the same request would fail again); returns the message."""
    with pytest.raises(grpc.RpcError) as e:
        call()
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, e.value.details()
    status = rpc_status.from_call(e.value)
    assert status is None or not status.details  # no RetryInfo
    return str(e.value.details())


def test_replies_over_the_message_limit_are_refused_without_error_logs(
    tiny_models: dict[str, Path], caplog: pytest.LogCaptureFixture
) -> None:
    """Left to gRPC, a reply over max_message_bytes fails in its core after the handler, and
    every such call logs an ERROR with a traceback; the stream's request is aborted too."""
    server = serve(
        [ModelSpec("tiny-a", str(tiny_models["tiny-a"]))], max_message_bytes=MESSAGE_LIMIT
    )
    options = [("grpc.max_receive_message_length", 64 * MESSAGE_LIMIT)]
    try:
        with grpc.insecure_channel(server.target, options=options) as channel:
            stub = inference_pb2_grpc.InferenceStub(channel)
            inputs = [common_pb2.Input(text="hi")] * 200  # 200 vectors: far more than 16 KiB
            embed = pooling_pb2.EmbedRequest(model="tiny-a", inputs=inputs)
            message = _too_large(lambda: stub.Embed(embed, timeout=30))
            assert f"limit of {MESSAGE_LIMIT} bytes (max_message_bytes)" in message
            params = generate_pb2.SamplingParams(max_tokens=4, prompt_logprobs=20)
            prompt = common_pb2.TokenIds(ids=[5, 6, 7] * 200)  # its logprobs: > 16 KiB
            generate = generate_pb2.GenerateRequest(token_ids=prompt, params=params)
            _too_large(lambda: list(stub.Generate(generate, timeout=30)))
            # closed with the call, not whenever the garbage collector gets to it
            assert server.handle("tiny-a").engine.num_in_flight == 0
            wait_all_blocks_free(server.handle("tiny-a"))
            server.wait_idle()
            embed = pooling_pb2.EmbedRequest(model="tiny-a", inputs=inputs[:2])
            assert len(stub.Embed(embed, timeout=30).embeddings) == 2
    finally:
        server.stop()
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]


def test_server_caps_on_prompt_and_n(small_server: ServerThread) -> None:
    with Client(small_server.target, timeout=60) as c:
        with pytest.raises(MMServeError) as e:
            c.generate(list(range(9)), max_tokens=2)
        assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert "token_ids" in e.value.message and "server limit 8" in e.value.message
        with pytest.raises(MMServeError) as e:
            c.generate("Hello", n=3, max_tokens=2)
        assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and "params.n" in e.value.message
        assert len(c.generate(list(range(8)), n=2, max_tokens=2)) == 2


def test_dead_engine_is_unavailable_and_not_serving(tiny_models: dict[str, Path]) -> None:
    server = serve([ModelSpec("tiny-b", str(tiny_models["tiny-b"]))], restart_dead_engines=False)
    try:
        handle = server.handle("tiny-b")

        def broken_step() -> None:
            raise RuntimeError("simulated device failure")

        handle.frontend.step = broken_step
        with Client(server.target, timeout=30) as c:
            with pytest.raises(MMServeError) as e:
                c.generate("Hello", max_tokens=3)
            assert e.value.code == grpc.StatusCode.INTERNAL  # the engine failed it
            assert "simulated device failure" in e.value.message
            deadline = time.monotonic() + 10
            while _health(server.target, "tiny-b") != health_pb2.HealthCheckResponse.NOT_SERVING:
                assert time.monotonic() < deadline
                time.sleep(0.1)
            assert _health(server.target) == health_pb2.HealthCheckResponse.NOT_SERVING
            with pytest.raises(MMServeError) as e:  # later requests fail fast
                c.generate("Hello", max_tokens=3)
            assert e.value.code == grpc.StatusCode.UNAVAILABLE
            assert c.tokenize("still works").token_ids  # the tokenizer is not the engine
    finally:
        server.stop()
