"""`mmserve bench prefix` end to end on a tiny random Llama: a miss and a hit line per phase,
the prefix cache serving the system prompt's full blocks on every hit and nothing on a miss,
and the speedup line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.bench.conftest import bench_args
from tests.utils.tiny_models import make_tiny_model


def test_bench_prefix_on_a_tiny_llama(tmp_path: Path, capsys: pytest.CaptureFixture[str], one_thread: None) -> None:
    model = make_tiny_model(tmp_path, arch="llama")
    args = bench_args(
        "prefix", "--model", str(model), "--device", "cpu", "--dtype", "float32",
        "--max-model-len", "256", "--num-kv-blocks", "64",
        "--system-len", "70", "--turn-len", "9", "--num-rounds", "3",
    )  # fmt: skip
    args.func(args)
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    phases = {line["phase"]: line for line in lines if line["bench"] == "prefix-ttft"}
    assert list(phases) == ["miss", "hit"]
    assert phases["miss"]["num_cached_tokens"] == [0, 0, 0]
    assert phases["hit"]["num_cached_tokens"] == [64, 64, 64]  # 70 tokens: 4 full blocks of 16
    for line in phases.values():
        assert line["rounds"] == 3 and line["block_size"] == 16
        assert 0 < line["ttft_ms_median"] <= line["ttft_ms_p90"]
    (summary,) = [line for line in lines if line["bench"] == "prefix"]
    assert summary["hit_speedup"] == pytest.approx(summary["miss_ms"] / summary["hit_ms"])


def test_bench_prefix_refuses_empty_rounds() -> None:
    args = bench_args("prefix", "--num-rounds", "0")
    with pytest.raises(ValueError, match="--num-rounds"):
        args.func(args)
