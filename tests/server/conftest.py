"""Fixtures of the server tests: real MMServers on free loopback ports, each on its own event
loop thread, talked to through the SDK and raw stubs. Tiny random models make most servers
cheap; SmolLM2 is loaded once, by test_server_smollm2.py."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Coroutine, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any, TypeVar

import grpc
import pytest

from mmserve.config import CacheConfig, EngineConfig, ModelConfig
from mmserve.server.config import ModelSpec, ServerConfig
from mmserve.server.grpc_server import MMServer
from mmserve.server.models import ModelHandle, ModelRegistry, load_models
from mmserve_client.v1 import inference_pb2_grpc
from tests.utils.tiny_models import make_tiny_model

T = TypeVar("T")
TINY_KV_BLOCKS = 640  # of 4 tokens: two full-context streams of tiny-a at once
TEST_CONFIG = ServerConfig(port=0, shutdown_grace=5.0)


class ServerThread:
    """An MMServer serving from a background thread's event loop."""

    def __init__(self, registry: ModelRegistry, config: ServerConfig = TEST_CONFIG) -> None:
        self.registry = registry
        self.server = MMServer(registry, config)
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.port = 0

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 60) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def start(self) -> ServerThread:
        self._thread.start()
        self.port = self.run(self.server.start())
        return self

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def handle(self, name: str = "") -> ModelHandle:
        return self.registry.get(name)

    def wait_idle(self) -> None:
        """Until no call holds an admission slot (a cancelled call lets go asynchronously)."""
        assert self.run(self.server.admission.wait_idle(10))

    def stop(self) -> None:
        self.run(self.server.drain(grace=2.0))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)


def tiny_template(num_blocks: int = TINY_KV_BLOCKS) -> EngineConfig:
    return EngineConfig(
        model=ModelConfig(model="", device="cpu", dtype="float32"),
        cache=CacheConfig(block_size=4, num_blocks=num_blocks),
    )


def load_registry(specs: list[ModelSpec], config: ServerConfig = TEST_CONFIG) -> ModelRegistry:
    return load_models(specs, tiny_template(), config)


def serve(specs: list[ModelSpec], **config: Any) -> ServerThread:
    cfg = replace(TEST_CONFIG, **config)
    return ServerThread(load_registry(specs, cfg), cfg).start()


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Two different tiny random checkpoints (architectures, seeds, contexts). tiny-a's long
    context makes streams that last long enough to cancel mid-way."""
    root = tmp_path_factory.mktemp("tiny")
    return {
        "tiny-a": make_tiny_model(
            root, arch="llama", seed=0, name="a", max_position_embeddings=1024
        ),
        "tiny-b": make_tiny_model(root, arch="qwen2", seed=1, name="b"),
    }


@pytest.fixture(scope="module")
def tiny_server(tiny_models: dict[str, Path]) -> Iterator[ServerThread]:
    """One server hosting tiny-a and tiny-b, for the whole test module."""
    server = serve([ModelSpec(name, str(path)) for name, path in tiny_models.items()])
    yield server
    server.stop()


@pytest.fixture
def stub(tiny_server: ServerThread) -> Iterator[Any]:
    with grpc.insecure_channel(tiny_server.target) as channel:
        yield inference_pb2_grpc.InferenceStub(channel)


def wait_all_blocks_free(handle: ModelHandle, timeout: float = 10.0) -> None:
    """Every KV block of the model free (empty or cached), within `timeout` (an abort reaches
    the engine thread asynchronously)."""
    pool = handle.frontend.core.kv.pool
    deadline = time.monotonic() + timeout
    while pool.num_free_blocks != pool.num_blocks and time.monotonic() < deadline:
        time.sleep(0.01)
    assert pool.num_free_blocks == pool.num_blocks, (pool.num_free_blocks, pool.num_blocks)
    assert handle.engine.num_in_flight == 0
