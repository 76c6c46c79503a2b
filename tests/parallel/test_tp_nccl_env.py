"""The NCCL settings of tensor-parallel ranks: spawned ranks share this host, so NCCL's
bootstrap sockets bind the loopback interface (as the store and the gloo groups bind
127.0.0.1); a value the user set wins, and NVLink multicast stays off."""

from __future__ import annotations

import io
import subprocess
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
