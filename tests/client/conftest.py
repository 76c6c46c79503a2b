"""Fixtures of the SDK tests: the fake servicer (fake_inference.py) served in-process by a sync
grpc server on 127.0.0.1, port chosen by the OS, for the whole session."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent import futures

import grpc
import pytest
from fake_inference import FakeInference

from mmserve_client import Client
from mmserve_client.v1 import inference_pb2_grpc


@pytest.fixture(scope="session")
def server() -> Iterator[tuple[FakeInference, str]]:
    """The fake servicer and its target, for the whole session."""
    fake = FakeInference()
    srv = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    inference_pb2_grpc.add_InferenceServicer_to_server(fake, srv)
    port = srv.add_insecure_port("127.0.0.1:0")
    srv.start()
    yield fake, f"127.0.0.1:{port}"
    srv.stop(grace=None)


@pytest.fixture
def fake(server: tuple[FakeInference, str]) -> FakeInference:
    """The servicer, its records cleared."""
    server[0].reset()
    return server[0]


@pytest.fixture
def target(server: tuple[FakeInference, str]) -> str:
    """host:port of the fake server."""
    return server[1]


@pytest.fixture
def client(target: str) -> Iterator[Client]:
    """A sync client of the fake server with an API key."""
    with Client(target, api_key="sekret", timeout=10) as c:
        yield c
