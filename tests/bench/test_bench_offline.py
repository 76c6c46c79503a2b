"""The offline benchmarks' rooflines against an independent count (transformers' own model
built on the meta device), and `bench throughput` end to end on a tiny model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from mmserve.bench import cli
from mmserve.bench.models import SHAPES, weight_bytes
from tests.bench.conftest import bench_args
from tests.utils.tiny_models import make_tiny_model


def _hf_parameters(config: dict) -> dict[str, int]:
    """Parameter counts of transformers' LlamaForCausalLM for config: projections, LM head,
    everything."""
    import transformers

    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config))
    counts = {"projections": 0, "lm_head": model.lm_head.weight.numel(), "all": 0}
    for name, p in model.named_parameters():
        counts["all"] += p.numel()
        if ".layers." in name and name.endswith("proj.weight"):
            counts["projections"] += p.numel()
    return counts


def test_weight_bytes_count_what_the_model_holds() -> None:
    config = {
        k: v for k, v in SHAPES["llama3-8b"].items() if k not in ("architectures", "model_type")
    }
    counts = _hf_parameters(config)
    assert weight_bytes(SHAPES["llama3-8b"]) == 2 * counts["all"]  # 16.06 GB
    # fp8: the decoder projections at one byte, everything else still two
    assert (
        weight_bytes(SHAPES["llama3-8b"], quantization="fp8")
        == 2 * counts["all"] - counts["projections"]
    )


def test_throughput_flops_count_the_lm_head_only_where_tokens_are_sampled() -> None:
    shape = SHAPES["llama3-8b"]
    config = {k: v for k, v in shape.items() if k not in ("architectures", "model_type")}
    counts = _hf_parameters(config)
    requests, input_len, output_len = 10, 512, 128
    tokens = input_len + output_len
    layer_params = (
        counts["all"]
        - 2 * counts["lm_head"]
        - (shape["num_hidden_layers"] * 2 + 1) * shape["hidden_size"]
    )
    assert layer_params == counts["projections"]  # norms aside, the layers are their projections
    h, layers = shape["hidden_size"], shape["num_hidden_layers"]
    attention = 2 * 2 * layers * h * requests * tokens * tokens / 2  # QK^T and PV, causal
    expected = 2 * layer_params * requests * tokens + 2 * counts["lm_head"] * requests * output_len
    # the norms' weights count as parameters there: 4e-5 of the total
    got = cli.throughput_flops(shape, requests, input_len, output_len)
    assert got == pytest.approx(expected + attention, rel=1e-4)


def test_bench_throughput_reports_its_flop_bound(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], one_thread: None
) -> None:
    path = make_tiny_model(tmp_path, "llama")
    flags = ["--model", str(path), "--device", "cpu", "--num-requests", "3", "--input-len", "8"]
    cli.run(
        bench_args(
            "throughput",
            *flags,
            "--output-len",
            "4",
            "--max-model-len",
            "64",
            "--matmul-tflops",
            "0.5",
        )
    )
    (line,) = [json.loads(s) for s in capsys.readouterr().out.splitlines() if s.startswith("{")]
    assert (line["bench"], line["output_tokens"], line["input_tokens"]) == ("throughput", 12, 24)
    config = json.loads((path / "config.json").read_text())
    bound = cli.throughput_flops(config, 3, 8, 4) / 0.5e12
    assert line["flop_bound_s"] == pytest.approx(bound)
    assert line["fraction_of_flop_bound"] == pytest.approx(bound / line["seconds"])


def test_bench_engine_flags_are_the_engine_settings() -> None:
    """Each engine setting of `mmserve serve` is a bench flag of the same name and parsing
    (its seed aside: bench's --seed is serve's prompts'); unset ones take the dataclasses'
    defaults, except the bigger engine a benchmark wants; a bad value is refused the same way."""
    import argparse

    from mmserve.bench.engine_flags import BENCH_DEFAULTS, engine_config
    from mmserve.config import CacheConfig, engine_settings

    parser = argparse.ArgumentParser()
    cli.add_parser(parser.add_subparsers(dest="command"))
    flags = ["bench", "latency", "--kv-cache-memory", "1GiB", "--no-enable-prefix-caching",
             "--no-async-scheduling", "--block-size", "32"]  # fmt: skip
    config = engine_config(parser.parse_args(flags), "m", dummy=True)
    assert config.cache.kv_cache_memory_bytes == 1 << 30 and config.cache.block_size == 32
    assert not config.cache.enable_prefix_caching and not config.scheduler.async_scheduling
    assert config.model.load_format == "dummy"
    defaults = engine_config(parser.parse_args(["bench", "latency"]), "m", dummy=False)
    assert defaults.scheduler.max_num_seqs == BENCH_DEFAULTS["max_num_seqs"]
    assert defaults.model.max_model_len == BENCH_DEFAULTS["max_model_len"]
    assert defaults.cache == CacheConfig()
    bench = parser._subparsers._group_actions[0].choices["bench"]  # type: ignore[union-attr]
    options = {o for action in bench._actions for o in action.option_strings}
    assert {s.flag for s in engine_settings() if s.cli} <= options
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        engine_config(parser.parse_args([*flags, "--gpu-memory-utilization", "2"]), "m", dummy=True)
