"""The engine watchdog: an engine process killed while idle, or one that stops making steps
with work in flight, turns its model NOT_SERVING (Watch subscribers told) within a second or
two and its calls fail UNAVAILABLE; a slow but progressing engine, or an idle one, is left
alone. With restart_dead_engines the model comes back, serving as before."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from mmserve.server.config import ModelSpec
from mmserve.server.models import ModelRegistry, load_model
from mmserve_client import Client, MMServeError
from tests.server.conftest import TEST_CONFIG, ServerThread, tiny_template

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def _server(
    path: Path, engine_process: bool, stall_s: float = 30.0, restart: bool = False
) -> ServerThread:
    template = replace(tiny_template(), multiprocess=engine_process)
    config = replace(TEST_CONFIG, engine_stall_timeout=stall_s, restart_dead_engines=restart)
    handle = load_model(ModelSpec("m", str(path)), template, config.max_pending)
    return ServerThread(ModelRegistry([handle]), config).start()


def _health(target: str, service: str = "m") -> int:
    with grpc.insecure_channel(target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        return stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status


def _wait_for(predicate: Callable[[], bool], within: float) -> float:
    """Seconds until predicate() held; fails past `within`."""
    start = time.monotonic()
    while not predicate():
        assert time.monotonic() - start < within, f"not within {within}s"
        time.sleep(0.05)
    return time.monotonic() - start


def _watch(target: str, seen: list[int]) -> None:
    """Fills `seen` with the statuses of model "m" as a Watch subscriber gets them."""

    def run() -> None:
        with grpc.insecure_channel(target) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            try:
                for reply in stub.Watch(health_pb2.HealthCheckRequest(service="m"), timeout=30):
                    seen.append(reply.status)
                    if reply.status == NOT_SERVING:
                        return
            except grpc.RpcError:
                pass

    threading.Thread(target=run, daemon=True).start()
    _wait_for(lambda: seen == [SERVING], 5)


def test_an_engine_process_killed_while_idle_is_noticed(tiny_models: dict[str, Path]) -> None:
    server, watched = _server(tiny_models["tiny-b"], engine_process=True), list[int]()
    try:
        with Client(server.target, timeout=30) as c:
            assert len(c.generate([1, 2], max_tokens=2, ignore_eos=True).token_ids) == 2
            _watch(server.target, watched)
            pid = server.handle("m").frontend.client.pid  # type: ignore[attr-defined]
            os.kill(pid, signal.SIGKILL)
            assert _wait_for(lambda: _health(server.target) == NOT_SERVING, 3) < 2.5
            _wait_for(lambda: watched[-1:] == [NOT_SERVING], 2)
            assert _health(server.target, "") == NOT_SERVING
            with pytest.raises(MMServeError) as e:
                c.generate("Hello", max_tokens=2)
            assert e.value.code == grpc.StatusCode.UNAVAILABLE, e.value
            assert "/" not in str(e.value.message)  # no server paths
    finally:
        server.stop()


def test_a_stalled_engine_process_fails_its_stream_unavailable(
    tiny_models: dict[str, Path],
) -> None:
    """SIGSTOP of the engine core with a stream in flight: within the stall timeout the
    stream fails UNAVAILABLE and the model turns NOT_SERVING."""
    server = _server(tiny_models["tiny-a"], engine_process=True, stall_s=1.0)
    pid = server.handle("m").frontend.client.pid  # type: ignore[attr-defined]
    try:
        with Client(server.target, timeout=30) as c:
            stream = c.generate_stream([1, 2, 3], max_tokens=1000, ignore_eos=True)
            next(iter(stream))
            os.kill(pid, signal.SIGSTOP)
            start = time.monotonic()
            with pytest.raises(MMServeError) as e:
                for _ in stream:
                    pass
            assert e.value.code == grpc.StatusCode.UNAVAILABLE and "stalled" in e.value.message
            assert time.monotonic() - start < 5
            assert _health(server.target) == NOT_SERVING
    finally:
        os.kill(pid, signal.SIGCONT)  # so that it can be shut down (it was killed if not)
        server.stop()


def test_an_in_process_step_that_hangs_is_a_stall(tiny_models: dict[str, Path]) -> None:
    server = _server(tiny_models["tiny-b"], engine_process=False, stall_s=0.5)
    frontend = server.handle("m").frontend
    release, real = threading.Event(), frontend.step
    calls = [0]

    def hanging_step():  # type: ignore[no-untyped-def]
        calls[0] += 1
        if calls[0] > 2:
            release.wait(30)
        return real()

    frontend.step = hanging_step  # type: ignore[method-assign]
    try:
        with Client(server.target, timeout=30) as c:
            with pytest.raises(MMServeError) as e:
                c.generate([1, 2, 3], max_tokens=50, ignore_eos=True)
            assert e.value.code == grpc.StatusCode.UNAVAILABLE
            _wait_for(lambda: _health(server.target) == NOT_SERVING, 2)
    finally:
        release.set()
        server.stop()


def test_slow_progress_and_idleness_are_not_stalls(tiny_models: dict[str, Path]) -> None:
    """Steps of 0.15 s each, for longer than the 0.4 s stall timeout in all, finish; an idle
    engine stays SERVING well past the timeout."""
    server = _server(tiny_models["tiny-b"], engine_process=False, stall_s=0.4)
    frontend = server.handle("m").frontend
    real = frontend.step

    def slow_step():  # type: ignore[no-untyped-def]
        time.sleep(0.15)
        return real()

    frontend.step = slow_step  # type: ignore[method-assign]
    try:
        with Client(server.target, timeout=30) as c:
            out = c.generate([1, 2, 3], max_tokens=8, ignore_eos=True)
            assert len(out.token_ids) == 8
            time.sleep(1.0)  # idle, past the timeout
            assert _health(server.target) == SERVING
            assert len(c.generate([1, 2, 3], max_tokens=2, ignore_eos=True).token_ids) == 2
    finally:
        server.stop()


def test_a_killed_engine_process_is_restarted(tiny_models: dict[str, Path]) -> None:
    server = _server(tiny_models["tiny-b"], engine_process=True, restart=True)
    try:
        with Client(server.target, timeout=30) as c:
            before = c.generate([1, 2, 3], max_tokens=6, temperature=0, ignore_eos=True).token_ids
            os.kill(server.handle("m").frontend.client.pid, signal.SIGKILL)  # type: ignore[attr-defined]
            _wait_for(lambda: _health(server.target) == NOT_SERVING, 3)
            _wait_for(lambda: _health(server.target) == SERVING, 60)
            assert _health(server.target, "") == SERVING
            again = c.generate([1, 2, 3], max_tokens=6, temperature=0, ignore_eos=True).token_ids
            assert again == before
    finally:
        server.stop()
