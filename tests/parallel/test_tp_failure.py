"""A tensor-parallel rank that dies, or hangs past distributed_timeout, with a stream in
flight: the stream fails UNAVAILABLE, the model turns NOT_SERVING within a bound, and once the
server stops no rank process is left."""

from __future__ import annotations

import os
import signal
import time
from dataclasses import replace
from pathlib import Path

import grpc
import pytest

from mmserve.config import ParallelConfig
from mmserve.server.config import ModelSpec
from mmserve.server.models import ModelRegistry, load_model
from mmserve_client import Client, MMServeError
from tests.server.conftest import TEST_CONFIG, ServerThread, tiny_template
from tests.server.test_server_watchdog import NOT_SERVING, SERVING, _health, _wait_for
from tests.utils.tiny_models import make_tiny_model


def rank_pids() -> list[int]:
    """Tensor-parallel rank processes (mmserve.engine.tp_workers) descended from this one
    (children of the engine process when there is one)."""
    parents: dict[int, int] = {}
    ranks: list[int] = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                parents[int(entry)] = int(f.read().rpartition(")")[2].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                if b"mmserve.engine.tp_workers" in f.read():
                    ranks.append(int(entry))
        except OSError:
            continue

    def descends(pid: int) -> bool:
        while pid > 1:
            pid = parents.get(pid, 0)
            if pid == os.getpid():
                return True
        return False

    return [pid for pid in ranks if descends(pid)]


@pytest.mark.parametrize(
    ("how", "engine_process"),
    [(signal.SIGKILL, True), (signal.SIGSTOP, False)],
    ids=["killed-engine-process", "hung-in-process"],
)
def test_a_lost_rank_fails_the_stream_and_the_model(
    tmp_path: Path, how: signal.Signals, engine_process: bool
) -> None:
    """Killed: rank 0's next collective finds the socket closed, in the engine process,
    whose error reaches the front end as a lost rank. Hung (SIGSTOP): the collective times
    out after distributed_timeout."""
    path = make_tiny_model(tmp_path, "llama", max_position_embeddings=1024)
    template = replace(
        tiny_template(),
        # long enough for a healthy step on a loaded CI machine, short for the hung case
        parallel=ParallelConfig(tensor_parallel_size=2, distributed_timeout=3.0),
        multiprocess=engine_process,
    )
    config = replace(TEST_CONFIG, restart_dead_engines=False)
    before = set(rank_pids())
    handle = load_model(ModelSpec("m", str(path)), template, config.max_pending)
    server = ServerThread(ModelRegistry([handle]), config).start()
    (rank1,) = set(rank_pids()) - before
    try:
        assert _health(server.target) == SERVING
        with Client(server.target, timeout=30) as c:
            stream = c.generate_stream([1, 2, 3], max_tokens=900, ignore_eos=True)
            next(iter(stream))
            os.kill(rank1, how)
            start = time.monotonic()
            with pytest.raises(MMServeError) as e:
                for _ in stream:
                    pass
            assert e.value.code == grpc.StatusCode.UNAVAILABLE, e.value
            assert time.monotonic() - start < 8  # distributed_timeout 3 s for the hung one
            _wait_for(lambda: _health(server.target) == NOT_SERVING, 2)
            with pytest.raises(MMServeError) as later:
                c.generate([1, 2, 3], max_tokens=2)
            assert later.value.code == grpc.StatusCode.UNAVAILABLE
    finally:
        server.stop()  # shuts the engine down: every rank stopped and reaped
    assert set(rank_pids()) - before == set()
    with pytest.raises(ProcessLookupError):
        os.kill(rank1, 0)  # reaped, not a zombie
