"""Bytes that do not decode as the request message: INVALID_ARGUMENT naming the message type
on every Inference method and on Health/Check (grpc alone answers UNKNOWN and logs a
traceback per call), at most one log line per method and window, and a healthy server."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from google.protobuf.descriptor import MethodDescriptor
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)

from mmserve.server.config import ModelSpec
from mmserve.server.decode_guard import RateLimitedLog
from tests.server.conftest import ServerThread, serve
from tests.server.raw_rpc import HEALTH_CHECK, INFERENCE, bad_utf8, call_raw, path, truncated

HEALTH_WATCH = HEALTH_CHECK.containing_service.methods_by_name["Watch"]  # reader/writer style
METHODS = [*INFERENCE.methods, HEALTH_CHECK, HEALTH_WATCH]
REFLECTION = "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo"
CORRUPT = b"\xff\xff\xff"  # field number 0x1fffffff... with wire type 7: no such wire type


@pytest.fixture(scope="module")
def server(tiny_models: dict[str, Path]) -> Iterator[ServerThread]:
    server = serve([ModelSpec("tiny-a", str(tiny_models["tiny-a"]))])
    yield server
    server.stop()


def _payloads(method: MethodDescriptor) -> dict[str, bytes]:
    return {
        "corrupt": CORRUPT,
        "truncated": truncated(method.input_type),
        "bad utf-8": bad_utf8(method.input_type),
    }


def test_undecodable_requests_are_invalid_argument_without_tracebacks(
    server: ServerThread, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    with grpc.insecure_channel(server.target) as channel:
        for method in METHODS:
            for kind, payload in _payloads(method).items():
                for _ in range(2):  # the second time, the warning is held back
                    got = call_raw(channel, method, payload, timeout=10)
                    assert got.code == grpc.StatusCode.INVALID_ARGUMENT, (path(method), kind, got)
                    assert got.details == f"request is not a valid {method.input_type.full_name}"
        health = health_pb2_grpc.HealthStub(channel)
        reply = health.Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
    assert not [r for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR]
    assert "Traceback" not in caplog.text
    warned = [r.getMessage() for r in caplog.records if "does not decode" in r.getMessage()]
    for method in METHODS:  # six undecodable calls each, one line at most in a 60 s window
        assert sum(m.startswith(f"{path(method)}:") for m in warned) <= 1, warned


def test_a_valid_request_after_garbage_is_served(server: ServerThread) -> None:
    embed = INFERENCE.methods_by_name["Embed"]
    with grpc.insecure_channel(server.target) as channel:
        assert call_raw(channel, embed, CORRUPT).code == grpc.StatusCode.INVALID_ARGUMENT
        request = embed.input_type._concrete_class(model="tiny-a", inputs=[{"text": "hi"}])
        got = call_raw(channel, embed, request.SerializeToString())
        assert got.code == grpc.StatusCode.OK, got


def test_undecodable_message_in_a_request_stream(server: ServerThread) -> None:
    """Reflection takes a stream of requests: a bad one ends the call, good ones are served."""
    with grpc.insecure_channel(server.target) as channel:
        with pytest.raises(grpc.RpcError) as e:
            list(channel.stream_stream(REFLECTION)(iter([CORRUPT]), timeout=10))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert e.value.details() == (
            "request is not a valid grpc.reflection.v1alpha.ServerReflectionRequest"
        )
        assert INFERENCE.full_name in ProtoReflectionDescriptorDatabase(channel).get_services()


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_rate_limited_log_counts_what_it_held_back(caplog: pytest.LogCaptureFixture) -> None:
    clock, log = _Clock(), logging.getLogger("test.ratelimited")
    limited = RateLimitedLog(log, window_s=10.0, clock=clock)
    with caplog.at_level(logging.WARNING, logger="test.ratelimited"):
        for _ in range(5):
            limited.warning("/a", "a is bad")
        limited.warning("/b", "b is bad")  # its own window
        clock.now = 9.9
        limited.warning("/a", "a is bad")
        clock.now = 10.0
        limited.warning("/a", "a is bad")
        limited.warning("/a", "a is bad")
        clock.now = 20.0
        limited.warning("/a", "a is bad")
    assert [r.getMessage() for r in caplog.records] == [
        "a is bad",
        "b is bad",
        "a is bad (5 more since the last report)",
        "a is bad (1 more since the last report)",
    ]
