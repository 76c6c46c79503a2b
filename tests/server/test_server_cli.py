"""`mmserve serve`: flags and MMSERVE_* variables, and the SIGTERM drain of a real process."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from mmserve import envs
from mmserve.server import cli
from mmserve.server.config import (
    DEFAULT_EMBEDDER_NAME,
    DEFAULT_MODEL_NAME,
    ModelSpec,
    ServerConfig,
)
from mmserve_client import Client, MMServeError

REPO = Path(__file__).resolve().parents[2]


def test_flags_env_and_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MMSERVE_PORT", "6000")
    monkeypatch.setenv("MMSERVE_MAX_TOKENS", "77")
    monkeypatch.setenv("MMSERVE_KV_CACHE_MEMORY", "64MiB")
    monkeypatch.setenv("MMSERVE_ENABLE_PREFIX_CACHING", "false")
    monkeypatch.setenv("MMSERVE_MODEL", "a=/x/a, /y/b.Q8_0.gguf")
    args = cli.build_parser().parse_args(["serve", "--port", "7000", "--num-kv-blocks", "9"])
    config = cli.server_config(args)
    assert config.port == 7000  # the command line beats the environment
    assert config.max_tokens == 77 and config.host == ServerConfig.host
    template = cli.engine_template(args)
    assert template.cache.num_blocks == 9
    assert template.cache.kv_cache_memory_bytes == 64 << 20
    assert template.cache.enable_prefix_caching is False
    assert template.model.dtype == "auto"  # unset: the dataclass default
    assert cli.model_specs(args) == [ModelSpec("a", "/x/a"), ModelSpec("b.Q8_0", "/y/b.Q8_0.gguf")]


def test_default_model_and_bad_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    args = cli.build_parser().parse_args(["serve"])
    chat, embedder = cli.model_specs(args)
    assert chat.name == DEFAULT_MODEL_NAME and chat.path.endswith(".gguf")
    assert embedder.name == DEFAULT_EMBEDDER_NAME and Path(embedder.path, "modules.json").is_file()
    monkeypatch.setenv("MMSERVE_PORT", "eighty")
    assert cli.main(["serve"]) == 2
    with pytest.raises(ValueError, match="MMSERVE_PORT"):
        envs.serve_env()
    with pytest.raises(ValueError, match="tls_key"):
        ServerConfig(tls_cert="cert.pem")
    with pytest.raises(ValueError):
        ModelSpec.parse("=path")


def _start(model: Path, *flags: str) -> tuple[subprocess.Popen[str], int]:
    """`mmserve serve` in a subprocess; returns it and its port, read from its log."""
    env = {**os.environ, "MMSERVE_LOG_LEVEL": "INFO", "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "mmserve.server.cli",
            "serve",
            f"tiny={model}",
            "--port",
            "0",
            *flags,
        ],
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    assert proc.stderr is not None
    log = []
    for line in proc.stderr:
        log.append(line)
        found = re.search(r"listening on 127\.0\.0\.1:(\d+)", line)
        if found:
            return proc, int(found.group(1))
    raise AssertionError("server did not start:\n" + "".join(log))


def test_sigterm_drains(tiny_models: dict[str, Path]) -> None:
    proc, port = _start(tiny_models["tiny-a"], "--shutdown-grace", "60", "--num-kv-blocks", "300")
    target = f"127.0.0.1:{port}"
    try:
        with Client(target, timeout=60, retry_attempts=1) as c:
            running = c.generate_stream("Hello", max_tokens=1000, temperature=0, ignore_eos=True)
            got = list(next(running).token_ids)
            proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + 5  # until the signal lands (the stream runs on)
            with pytest.raises(MMServeError) as e:
                while time.monotonic() < deadline:
                    c.tokenize("new call")
                    time.sleep(0.02)
            assert e.value.code == grpc.StatusCode.UNAVAILABLE
            with grpc.insecure_channel(target) as channel:
                stub = health_pb2_grpc.HealthStub(channel)
                reply = stub.Check(health_pb2.HealthCheckRequest(), timeout=5)
                assert reply.status == health_pb2.HealthCheckResponse.NOT_SERVING
            for chunk in running:
                got += chunk.token_ids
                last = chunk
            assert len(got) == 1000 and last.finish_reason == "length"
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        assert proc.stderr is not None
        proc.stderr.close()


def test_gpu_memory_utilization_and_enforce_eager(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MMSERVE_GPU_MEMORY_UTILIZATION", "0.5")
    monkeypatch.setenv("MMSERVE_ENFORCE_EAGER", "true")
    template = cli.engine_template(cli.build_parser().parse_args(["serve"]))
    assert template.cache.gpu_memory_utilization == 0.5 and template.model.enforce_eager
    flags = ["serve", "--gpu-memory-utilization", "0.7", "--no-enforce-eager"]
    template = cli.engine_template(cli.build_parser().parse_args(flags))
    assert template.cache.gpu_memory_utilization == 0.7 and not template.model.enforce_eager
    assert cli.main(["serve", "--gpu-memory-utilization", "1.5"]) == 2


def test_engine_process_flag(monkeypatch: pytest.MonkeyPatch) -> None:
    parse = cli.build_parser().parse_args
    assert cli.engine_template(parse(["serve", "--device", "cpu"])).multiprocess  # on everywhere
    assert not cli.engine_template(parse(["serve", "--device", "cpu", "--no-engine-process"])).multiprocess
    assert cli.engine_template(parse(["serve"])).multiprocess
    assert not cli.engine_template(parse(["serve", "--no-engine-process"])).multiprocess
    monkeypatch.setenv("MMSERVE_ENGINE_PROCESS", "false")
    assert not cli.engine_template(cli.build_parser().parse_args(["serve"])).multiprocess


def test_async_scheduling_flag(monkeypatch: pytest.MonkeyPatch) -> None:
    parse = cli.build_parser().parse_args
    assert cli.engine_template(parse(["serve"])).scheduler.async_scheduling  # default on
    assert not cli.engine_template(parse(["serve", "--no-async-scheduling"])).scheduler.async_scheduling
    monkeypatch.setenv("MMSERVE_ASYNC_SCHEDULING", "false")
    parse = cli.build_parser().parse_args  # the environment is read when the parser is built
    assert not cli.engine_template(parse(["serve"])).scheduler.async_scheduling
    assert cli.engine_template(parse(["serve", "--async-scheduling"])).scheduler.async_scheduling
