"""Replicas behind one SDK client: several targets (or one gRPC name of several addresses),
round robin over them, a replica that drains (health NOT_SERVING, calls refused UNAVAILABLE)
left for the others with no failed call."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent import futures

import grpc
import pytest
from fake_inference import FakeInference
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from mmserve_client import Client
from mmserve_client._channel import channel_target
from mmserve_client.v1 import inference_pb2_grpc


class Replica:
    """A fake server with the standard health service, on a free loopback port."""

    def __init__(self) -> None:
        self.fake = FakeInference()
        self.health = health.HealthServicer()
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
        inference_pb2_grpc.add_InferenceServicer_to_server(self.fake, self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()
        self.health.set("", health_pb2.HealthCheckResponse.SERVING)

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def drain(self) -> None:
        """As mmserve drains: NOT_SERVING, and every new call refused UNAVAILABLE."""
        self.health.enter_graceful_shutdown()
        self.fake.draining = True


@pytest.fixture
def replicas() -> Iterator[tuple[Replica, Replica]]:
    pair = (Replica(), Replica())
    yield pair
    for r in pair:
        r.server.stop(grace=None)


def test_several_targets_become_one_address_list() -> None:
    assert channel_target("dns:///h:1") == "dns:///h:1"
    assert channel_target(["127.0.0.1:1", "localhost:2"]) in (
        "ipv4:127.0.0.1:1,127.0.0.1:2",
        "ipv6:[::1]:1,[::1]:2",
    )
    with pytest.raises(ValueError, match="host:port"):
        channel_target(["127.0.0.1", "127.0.0.1:2"])


@pytest.mark.parametrize("as_name", [False, True], ids=["list", "ipv4-name"])
def test_calls_alternate_between_replicas(replicas: tuple[Replica, Replica], as_name: bool) -> None:
    a, b = replicas
    targets = [a.target, b.target]
    target = f"ipv4:{','.join(targets)}" if as_name else targets
    with Client(target, timeout=10) as c:
        c.wait_ready(10)
        time.sleep(0.2)  # round robin starts once both subchannels are READY
        for i in range(20):
            assert c.tokenize(f"t{i}").token_ids
            assert c.generate("hi").text == "hi"
    assert (a.fake.served, b.fake.served) == (20, 20)


def test_a_draining_replica_sends_the_rest_to_the_other(
    replicas: tuple[Replica, Replica],
) -> None:
    """Calls run back to back from two threads while one replica drains: none fails, and
    the drained one answers no more."""
    a, b = replicas
    failures: list[BaseException] = []
    done = threading.Event()
    with Client([a.target, b.target], timeout=10) as c:
        c.wait_ready(10)

        def caller() -> None:
            while not done.is_set():
                try:
                    assert c.generate("ok").text == "ok"
                    c.embed(["abc"])
                except BaseException as e:  # noqa: BLE001 - reported by the test
                    failures.append(e)

        threads = [threading.Thread(target=caller) for _ in range(2)]
        for t in threads:
            t.start()
        time.sleep(0.3)
        a.drain()
        time.sleep(0.3)  # the health watch reaches the client; calls racing it are retried
        served_a, served_b, refused = a.fake.served, b.fake.served, a.fake.refused
        time.sleep(0.5)
        done.set()
        for t in threads:
            t.join(10)
    assert failures == []
    assert a.fake.served == served_a  # no call reached the drained replica's servicer since
    assert a.fake.refused == refused  # nor was refused: its NOT_SERVING took it off the list
    assert b.fake.served > served_b + 10


def test_health_checking_is_on_for_several_targets_or_when_asked() -> None:
    from mmserve_client._channel import health_service

    assert health_service(["a:1", "b:2"], None) == ""
    assert health_service("dns:///h:1", None) is None  # one target: as before
    assert health_service(["a:1"], None) is None
    assert health_service("dns:///h:1", True) == ""
    assert health_service("dns:///h:1", "chat") == "chat"  # a model's own status
    assert health_service(["a:1", "b:2"], False) is None
