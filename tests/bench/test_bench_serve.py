"""`mmserve bench serve` end to end: an in-process server of a tiny random model, two request
rates, and the JSON line of each checked for sane figures; plus the pure parts (rates, targets,
metrics) on their own."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from mmserve.bench import cli
from mmserve.bench.serve import loopback_target, parse_rates
from mmserve.bench.serve_metrics import RequestResult, summarize
from tests.utils.tiny_models import make_tiny_model

NUM_REQUESTS = 8


def _args(*flags: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    cli.add_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["bench", "serve", *flags])


def test_rates_and_targets() -> None:
    assert parse_rates(None) == [float("inf")]
    assert parse_rates(["1,4", "inf"]) == [1.0, 4.0, float("inf")]
    for bad in (["0"], ["-2"], [","]):
        with pytest.raises(ValueError, match="--request-rate"):
            parse_rates(bad)
    for ok in ("127.0.0.1:50051", "localhost:1", "[::1]:8000", "127.3.2.1:9"):
        assert loopback_target(ok) == ok
    for bad_target in ("10.0.0.1:50051", "example.com:443", "127.0.0.1", "[::]:80"):
        with pytest.raises(ValueError, match="--target"):
            loopback_target(bad_target)


def test_summarize_follows_vllm_definitions() -> None:
    fast = RequestResult(
        True, ttft=0.1, latency=0.5, itl=[0.2, 0.2], prompt_tokens=4, output_tokens=3
    )
    slow = RequestResult(True, ttft=1.0, latency=1.0, prompt_tokens=4, output_tokens=1)
    out = summarize([fast, slow, RequestResult(False, error="x")], 2.0, 500.0, 250.0)
    assert (out["completed"], out["failed"], out["errors"]) == (2, 1, ["x"])
    assert out["request_throughput"] == 1.0 and out["output_throughput"] == 2.0
    assert out["goodput"] == 0.5  # slow misses the TTFT SLO; its TPOT counts as 0
    assert out["mean_tpot_ms"] == pytest.approx(200.0)  # only requests of > 1 token
    assert out["median_itl_ms"] == pytest.approx(200.0)
    assert out["mean_ttft_ms"] == pytest.approx(550.0)
    assert out["slowest_ttft_ms"] == [(1, pytest.approx(1000.0)), (0, pytest.approx(100.0))]
    empty = summarize([RequestResult(False)], 1.0, None, None)
    assert empty["p99_ttft_ms"] is None and empty["goodput"] == 0.0


def test_bench_serve_in_process(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = make_tiny_model(tmp_path, arch="llama", seed=0)
    args = _args(
        "--model", str(model), "--device", "cpu", "--dtype", "float32",
        "--max-model-len", "256", "--num-kv-blocks", "64",
        "--input-len", "12", "--output-len", "6", "--num-requests", str(NUM_REQUESTS),
        "--request-rate", "20", "--request-rate", "inf",
        "--slo-ttft-ms", "60000", "--slo-tpot-ms", "0.001", "--max-duration-s", "60",
        "--metrics",  # the server exports its metrics meanwhile (what they cost, on the GPU)
    )  # fmt: skip
    args.func(args)
    start, *lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert start["bench"] == "serve-start" and start["start_s"] > 0 and start["warmup"] is None
    assert [line["request_rate"] for line in lines] == [20.0, "inf"]
    for line in lines:
        assert line["bench"] == "serve" and line["errors"] == [] and line["metrics"] is True
        assert (line["completed"], line["failed"]) == (NUM_REQUESTS, 0)
        assert line["total_output_tokens"] == 6 * NUM_REQUESTS
        assert line["total_input_tokens"] == 12 * NUM_REQUESTS
        assert 0 < line["mean_ttft_ms"] <= line["mean_e2el_ms"]
        assert 0 < line["p99_ttft_ms"] <= line["p99_e2el_ms"]
        assert line["median_tpot_ms"] > 0 and line["median_itl_ms"] > 0
        assert line["request_throughput"] == pytest.approx(NUM_REQUESTS / line["duration_s"])
        assert line["output_throughput"] == pytest.approx(6 * line["request_throughput"])
        assert 0 <= line["goodput"] <= line["request_throughput"]
        assert line["goodput"] == 0  # no request makes a 1-microsecond TPOT
