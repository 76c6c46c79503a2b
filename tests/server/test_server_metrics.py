"""Prometheus metrics end to end: a known load against a server with --metrics-port, scraped
over HTTP and parsed with prometheus_client's parser; the counters checked exactly against
what the responses (and, for cancelled calls, the access log) said. The same with the engine
core in its own process: its counts come on the Outputs messages."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from mmserve.server.config import ModelSpec
from mmserve.server.models import load_models
from tests.server.conftest import TEST_CONFIG, ServerThread, tiny_template
from tests.server.metrics_load import Load, run_load, scrape, value

HISTOGRAMS_PER_REQUEST = (  # one observation per Generate request that reached the engine
    "e2e_request_latency_seconds", "time_to_first_token_seconds", "request_queue_time_seconds",
    "request_prefill_time_seconds", "request_decode_time_seconds",
    "request_inference_time_seconds", "request_prompt_tokens", "request_generation_tokens",
)  # fmt: skip


def metrics_server(
    tiny_models: dict[str, Path], engine_process: bool, num_blocks: int | None = None, **config: Any
) -> ServerThread:
    cfg = replace(TEST_CONFIG, metrics_port=0, **config)
    template = replace(tiny_template(num_blocks or 640), multiprocess=engine_process)
    registry = load_models([ModelSpec("tiny-a", str(tiny_models["tiny-a"]))], template, cfg)
    return ServerThread(registry, cfg).start()


@pytest.fixture(scope="module", params=[False, True], ids=["in-process", "engine-process"])
def server(request: pytest.FixtureRequest, tiny_models: dict[str, Path]) -> Iterator[ServerThread]:
    s = metrics_server(tiny_models, request.param)
    yield s
    s.stop()


def idle_scrape(server: ServerThread, timeout: float = 10.0) -> dict[str, Any]:
    """A scrape once the engine reports nothing running or waiting (stats arrive after the
    last step, asynchronously with an engine process)."""
    server.wait_idle()
    port = server.server.metrics_port
    assert port
    deadline = time.monotonic() + timeout
    while True:
        samples = scrape(port)
        busy = value(samples, "mmserve:num_requests_running") + value(
            samples, "mmserve:num_requests_waiting"
        )
        if not busy and not value(samples, "mmserve:num_tokens_in_flight") or time.monotonic() > deadline:
            return samples
        time.sleep(0.05)


def access_lines(caplog: pytest.LogCaptureFixture) -> list[dict[str, Any]]:
    return [r.access for r in caplog.records if r.name == "mmserve.access"]  # type: ignore[attr-defined]


def test_known_load(server: ServerThread, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="mmserve.access"):
        load = run_load(server.target)
        samples = idle_scrape(server)
        deadline = time.monotonic() + 10  # the cancelled calls end on the server's own time
        while len(access_lines(caplog)) < sum(load.calls.values()) and time.monotonic() < deadline:
            time.sleep(0.05)
    lines = access_lines(caplog)
    cancelled = [line for line in lines if line["status"] == "CANCELLED"]
    assert sorted(c["request_id"] for c in cancelled) == sorted(load.cancelled_ids)
    check_calls(samples, load)
    check_tokens(samples, load, cancelled)
    check_histograms(samples, load, cancelled)
    check_idle_gauges(samples)


def check_calls(samples: dict[str, Any], load: Load) -> None:
    for (method, code), count in load.calls.items():
        got = value(samples, "mmserve:grpc_calls_total", method=method, code=code, model_name="tiny-a")
        assert got == count, (method, code)
    for reason, count in load.reasons().items():
        got = value(samples, "mmserve:request_success_total", finished_reason=reason)
        assert got == count, reason
    assert value(samples, "mmserve:pooling_inputs_total", task="embed") == load.embed_inputs


def check_tokens(samples: dict[str, Any], load: Load, cancelled: list[dict[str, Any]]) -> None:
    prompts = sum(r.usage.prompt_tokens for r in load.finished) + sum(load.cancelled_prompts)
    assert value(samples, "mmserve:prompt_tokens_total") == prompts + load.embed_prompt_tokens
    generated = sum(r.usage.completion_tokens for r in load.finished)
    streamed = sum(c["output_tokens"] for c in cancelled)
    assert streamed >= len(cancelled)  # each had sent its first token before it was cancelled
    assert value(samples, "mmserve:generation_tokens_total") == generated + streamed
    hits = sum(r.usage.cached_tokens for r in load.finished)
    assert hits == 2 * 20  # SHARED's 5 full blocks of 4, twice
    assert value(samples, "mmserve:prefix_cache_hits_total") == hits
    assert value(samples, "mmserve:prefix_cache_queries_total") == prompts  # pooling: no lookup
    assert value(samples, "mmserve:num_preemptions_total") == 0


def check_histograms(samples: dict[str, Any], load: Load, cancelled: list[dict[str, Any]]) -> None:
    for name in HISTOGRAMS_PER_REQUEST:
        assert value(samples, f"mmserve:{name}_count") == load.num_requests, name
    tokens = [r.usage.completion_tokens for r in load.finished]
    tokens += [c["output_tokens"] for c in cancelled]
    gaps = sum(max(n - 1, 0) for n in tokens)
    assert value(samples, "mmserve:inter_token_latency_seconds_count") == gaps
    multi = sum(n > 1 for n in tokens)
    assert value(samples, "mmserve:request_time_per_output_token_seconds_count") == multi
    assert value(samples, "mmserve:request_generation_tokens_sum") == sum(tokens)
    inf = value(samples, "mmserve:time_to_first_token_seconds_bucket", le="+Inf")
    assert inf == load.num_requests


def check_idle_gauges(samples: dict[str, Any]) -> None:
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
                 "num_tokens_in_flight"):  # fmt: skip
        series = samples[f"mmserve:{name}"]
        assert series == [({"model_name": "tiny-a"}, 0.0)], name
    assert value(samples, "mmserve:kv_cache_free_blocks") == 640


def test_metrics_text_has_no_paths_or_keys(server: ServerThread, tiny_models: dict[str, Path]) -> None:
    text = scrape(server.server.metrics_port or 0)["_text"]
    assert str(tiny_models["tiny-a"].parent) not in text and "/tmp" not in text
    assert "python_info" not in text and "process_" not in text  # our own registry only


@pytest.mark.parametrize("engine_process", [False, True], ids=["in-process", "engine-process"])
def test_preemption_on_a_tiny_kv_pool(tiny_models: dict[str, Path], engine_process: bool) -> None:
    """16 blocks of 4 tokens: two 20-token prompts growing to 50 tokens cannot both stay."""
    import threading

    import grpc

    from mmserve_client.v1 import inference_pb2_grpc
    from tests.server.metrics_load import _request

    server = metrics_server(tiny_models, engine_process, num_blocks=16)
    try:
        results: list[Any] = []
        with grpc.insecure_channel(server.target) as channel:
            stub = inference_pb2_grpc.InferenceStub(channel)

            def one(start: int) -> None:
                prompt = list(range(start, start + 20))
                results.append(list(stub.Generate(_request(prompt, max_tokens=30), timeout=300))[-1])

            threads = [threading.Thread(target=one, args=(s,)) for s in (10, 100)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(300)
        samples = idle_scrape(server)
        assert [r.usage.completion_tokens for r in results] == [30, 30]
        assert value(samples, "mmserve:num_preemptions_total") >= 1
        assert value(samples, "mmserve:generation_tokens_total") == 60
        assert value(samples, "mmserve:request_success_total", finished_reason="length") == 2
        assert value(samples, "mmserve:num_requests_running") == 0
        assert value(samples, "mmserve:kv_cache_usage_perc") == 0
    finally:
        server.stop()
