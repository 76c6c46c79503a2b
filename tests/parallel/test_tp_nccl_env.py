"""The NCCL settings of tensor-parallel ranks: spawned ranks share this host, so NCCL's
bootstrap sockets bind the loopback interface (as the store and the gloo groups bind
127.0.0.1); a value the user set wins, and NVLink multicast stays off."""

from __future__ import annotations

import io
import subprocess
import types
from typing import Any

import pytest

from mmserve.engine import tp_workers
from mmserve.engine.tp_workers import NCCL_ENV, nccl_env, rank_env

LOOPBACK = {"NCCL_SOCKET_IFNAME": "=lo", "NCCL_SOCKET_FAMILY": "AF_INET"}


def test_spawned_ranks_bind_nccl_to_loopback() -> None:
    env = rank_env({"PATH": "/usr/bin"})
    assert env == {"PATH": "/usr/bin", **NCCL_ENV, **LOOPBACK}
    assert env["NCCL_NVLS_ENABLE"] == "0" and env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "2"


def test_torchrun_ranks_keep_nccls_own_interface() -> None:
    """Ranks torchrun started may be on other hosts: NCCL must reach them."""
    assert nccl_env(False, {}) == NCCL_ENV


@pytest.mark.parametrize(
    "user, expected",
    [
        ({"NCCL_SOCKET_IFNAME": "eth1"}, {"NCCL_SOCKET_IFNAME": "eth1"}),  # no family forced
        ({"NCCL_COMM_ID": "10.0.0.1:9000"}, {"NCCL_COMM_ID": "10.0.0.1:9000"}),  # its interface
        ({"NCCL_SOCKET_FAMILY": "AF_INET6"}, {**LOOPBACK, "NCCL_SOCKET_FAMILY": "AF_INET6"}),
        ({"NCCL_NVLS_ENABLE": "1"}, {**LOOPBACK, "NCCL_NVLS_ENABLE": "1"}),
    ],
)
def test_a_value_the_user_set_wins(user: dict[str, str], expected: dict[str, str]) -> None:
    assert rank_env(user) == {**NCCL_ENV, **expected}


def test_the_spawned_process_gets_them(monkeypatch: pytest.MonkeyPatch) -> None:
    """What _spawn hands to the rank's process (its environment and the config on stdin)."""
    monkeypatch.delenv("NCCL_SOCKET_IFNAME", raising=False)
    monkeypatch.delenv("NCCL_COMM_ID", raising=False)
    monkeypatch.delenv("NCCL_SOCKET_FAMILY", raising=False)
    started: dict[str, Any] = {}

    class Popen:
        def __init__(self, cmd: list[str], stdin: int, env: dict[str, str]) -> None:
            started.update(cmd=cmd, env=env)
            self.stdin = io.BytesIO()

    monkeypatch.setattr(subprocess, "Popen", Popen)
    tp_workers._spawn(1, 2, 4321, b"config")
    assert started["cmd"][-3:] == ["1", "2", "4321"]
    env = started["env"]
    assert {k: env[k] for k in (*NCCL_ENV, *LOOPBACK)} == {**NCCL_ENV, **LOOPBACK}


@pytest.mark.parametrize(
    "environ, one_host",
    [
        ({"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "10.0.0.1"}, True),  # all ranks local
        ({"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "10.0.0.1"}, False),  # two hosts
        ({"WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1"}, True),  # a loopback rendezvous
        ({"WORLD_SIZE": "2", "MASTER_ADDR": "localhost"}, True),
        ({"WORLD_SIZE": "2", "MASTER_ADDR": "node7"}, False),
        ({"WORLD_SIZE": "2"}, False),
    ],
)
def test_torchrun_on_one_host_is_told_apart(environ: dict[str, str], one_host: bool) -> None:
    from mmserve import envs

    assert envs.torchrun_one_host(environ) is one_host


def test_torchrun_ranks_of_one_host_bind_loopback(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 0 under a single-host torchrun (torchrun --standalone) makes its groups on loopback
    (gloo on 127.0.0.1, NCCL on lo), as spawned ranks do; across hosts it keeps the defaults."""
    import torch.distributed as dist

    from mmserve.config import EngineConfig, ModelConfig, ParallelConfig

    made: list[bool] = []
    monkeypatch.setattr(dist, "rendezvous", lambda *a, **k: iter([(object(), 0, 2)]))
    def make_groups(*args: Any, loopback: bool = False) -> Any:
        made.append(loopback)
        return types.SimpleNamespace(parallel=None, plans=None, timeout=None)

    monkeypatch.setattr(tp_workers, "make_groups", make_groups)
    config = EngineConfig(ModelConfig("unused", device="cpu"), parallel=ParallelConfig(tensor_parallel_size=2))
    for key, value in {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1"}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    tp_workers.start_ranks(config)
    monkeypatch.setenv("MASTER_ADDR", "10.0.0.1")
    tp_workers.start_ranks(config)
    assert made == [True, False]
