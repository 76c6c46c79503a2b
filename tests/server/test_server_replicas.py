"""Two mmserve servers on loopback behind one SDK client (a list of targets, round robin):
calls reach both, and draining one (SIGTERM's path: health NOT_SERVING, new calls refused
UNAVAILABLE for a while before gRPC stops, running ones finish) sends the rest to the other
with no failed call."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import grpc
import pytest

from mmserve.server.config import ModelSpec
from mmserve.server.grpc_server import DRAIN_SETTLE_S
from mmserve_client import Client
from mmserve_client.v1 import inference_pb2_grpc, models_pb2
from tests.server.conftest import serve


def test_two_servers_behind_one_client_survive_a_drain(tiny_models: dict[str, Path]) -> None:
    spec = [ModelSpec("m", str(tiny_models["tiny-b"]))]
    a, b = serve(spec), serve(spec)
    failures: list[BaseException] = []
    answered: list[int] = []
    done = threading.Event()
    try:
        with Client([a.target, b.target], timeout=30) as c:
            c.wait_ready(10)
            assert c.generate([1, 2, 3], model="m", max_tokens=2, ignore_eos=True).token_ids

            def caller() -> None:
                while not done.is_set():
                    try:
                        r = c.generate([1, 2, 3], model="m", max_tokens=4, ignore_eos=True)
                        answered.append(len(r.token_ids))
                    except BaseException as e:  # noqa: BLE001 - reported by the test
                        failures.append(e)

            threads = [threading.Thread(target=caller) for _ in range(3)]
            for t in threads:
                t.start()
            time.sleep(0.5)
            a.stop()  # drains (grace 2 s), then stops
            before = len(answered)
            time.sleep(0.5)
            done.set()
            for t in threads:
                t.join(30)
        assert failures == []
        assert len(answered) > before  # b kept answering after a was gone
        assert set(answered) == {4}
    finally:
        done.set()
        b.stop()


def test_a_drain_refuses_calls_unavailable_before_the_server_stops(tiny_models: dict[str, Path]) -> None:
    """Right after NOT_SERVING, with nothing in flight, the server keeps answering new calls
    UNAVAILABLE (retried elsewhere) for DRAIN_SETTLE_S before gRPC stops; a call reaching a
    stopping gRPC server is CANCELLED instead (grpc/grpc#41785), which no client retries."""
    server = serve([ModelSpec("m", str(tiny_models["tiny-b"]))])
    with grpc.insecure_channel(server.target, options=[("grpc.enable_retries", 0)]) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        stub.ListModels(models_pb2.ListModelsRequest(), timeout=5)  # (connected)
        start = time.monotonic()
        drained = asyncio.run_coroutine_threadsafe(server.server.drain(grace=5.0), server.loop)
        stopped: list[float] = []
        drained.add_done_callback(lambda _: stopped.append(time.monotonic()))
        refusals = []
        while time.monotonic() - start < 0.8 * DRAIN_SETTLE_S:
            with pytest.raises(grpc.RpcError) as refused:
                stub.ListModels(models_pb2.ListModelsRequest(), timeout=5)
            refusals.append((refused.value.code(), refused.value.details()))
            time.sleep(0.05)
    drained.result(30)
    server.loop.call_soon_threadsafe(server.loop.stop)
    assert stopped[0] - start >= DRAIN_SETTLE_S
    # refused by the server itself (the admission's words), not by a closed port
    assert refusals and all(code == grpc.StatusCode.UNAVAILABLE and "shutting down" in details
                            for code, details in refusals), refusals
