"""The offline benchmarks' rooflines against independent counts (transformers' own model built
on the meta device, and sums by hand over the loaded tiny models: bf16, tied, FP8, w4a16
packed), and `bench throughput / latency / decode` end to end on tiny models (a GGUF file
among them)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from mmserve.bench import cli
from mmserve.bench.models import SHAPES
from mmserve.bench.roofline import (
    decode_kv_read_bytes,
    matmul_parameters,
    step_weight_bytes,
    throughput_flops,
)
from mmserve.kernels import cpu_lib
from tests.bench.conftest import bench_args
from tests.utils.tiny_models import (
    TINY_VOCAB_SIZE,
    make_tiny_model,
    make_tiny_tokenizer,
    tiny_config,
)


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


def _loaded(path: Path, dtype: str = "bfloat16", **config: object) -> torch.nn.Module:
    from mmserve.attention.torch_ref import TorchAttentionBackend
    from mmserve.config import ModelConfig
    from mmserve.models.loader import load_model

    model, _, _ = load_model(ModelConfig(model=str(path), **config), "cpu", dtype, TorchAttentionBackend())  # type: ignore[arg-type]
    return model


# the tiny models' tensors (tests/utils/tiny_models.py): hidden 64, 2 layers, q 4 x 16, kv 2 x 16,
# FFN 128; as (rows, columns) per layer
H, LAYERS, V = 64, 2, TINY_VOCAB_SIZE
PROJECTIONS = [(64, 64), (32, 64), (32, 64), (64, 64), (128, 64), (128, 64), (64, 128)]
NORMS = LAYERS * 2 * H + H


def test_a_step_reads_every_weight_but_the_embedding(tmp_path: Path) -> None:
    """bf16: projections, norms and the head at 2 bytes, the embedding table not at all."""
    weights = LAYERS * sum(n * k for n, k in PROJECTIONS)
    model = _loaded(make_tiny_model(tmp_path, "llama"))
    assert step_weight_bytes(model) == 2 * (weights + NORMS + V * H)


def test_a_tied_head_reads_the_table_once(tmp_path: Path) -> None:
    weights = LAYERS * sum(n * k for n, k in PROJECTIONS)
    model = _loaded(make_tiny_model(tmp_path, "llama", tie_word_embeddings=True))
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert step_weight_bytes(model) == 2 * (weights + NORMS + V * H)


def test_fp8_reads_a_byte_per_weight_and_a_scale_per_channel(tmp_path: Path) -> None:
    weights = LAYERS * sum(n * k for n, k in PROJECTIONS)
    channels = LAYERS * sum(n for n, _ in PROJECTIONS)
    model = _loaded(make_tiny_model(tmp_path, "llama"), quantization="fp8")
    assert step_weight_bytes(model) == weights + 4 * channels + 2 * (NORMS + V * H)


def test_w4a16_reads_its_packed_weights_and_scales(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Kept packed (as on CUDA): int32 words of 8 weights, and a bf16 scale per group of 128
    inputs and output channel (a symmetric checkpoint: no zero points kept or read); the head
    stays bf16."""
    from mmserve.bench.checkpoints import write_checkpoint
    from mmserve.models import weight_only

    monkeypatch.setattr(weight_only, "PACKED_ON", ("cuda", "cpu"))
    base = tmp_path / "base"
    tiny_config(hidden_size=256, intermediate_size=512, head_dim=64).save_pretrained(base)
    make_tiny_tokenizer().save_pretrained(base)
    model = _loaded(write_checkpoint(base, "w4a16-g128", tmp_path / "w4a16", "tiny"))
    assert sum(isinstance(m, weight_only.WeightOnlyLinear) for m in model.modules()) == 2 * 4
    shapes = [(256, 256), (128, 256), (128, 256), (256, 256), (512, 256), (512, 256), (256, 512)]
    packed = sum(n * k // 2 + 2 * n * (k // 128) for n, k in shapes)  # 4 bits; scales
    assert step_weight_bytes(model) == 2 * packed + 2 * (2 * 2 * 256 + 256 + V * 256)


def test_the_8b_shape_reads_15_gb_in_bf16() -> None:
    """16.06 GB of weights, less the 1.05 GB embedding table (the issue's 3.59 ms floor at
    4,180 GB/s), counted on mmserve's own model built on the meta device."""
    from transformers import LlamaConfig

    from mmserve.attention.torch_ref import TorchAttentionBackend
    from mmserve.models.registry import get_model_class

    config = {k: v for k, v in SHAPES["llama3-8b"].items() if k not in ("architectures", "model_type")}
    counts = _hf_parameters(config)
    embedding = config["vocab_size"] * config["hidden_size"]
    with torch.device("meta"):
        model = get_model_class("LlamaForCausalLM")(LlamaConfig(**config), TorchAttentionBackend())
    model.to(torch.bfloat16)
    assert step_weight_bytes(model) == 2 * (counts["all"] - embedding)
    assert round(step_weight_bytes(model) / 1e9, 2) == 15.01
    assert matmul_parameters(SHAPES["llama3-8b"]) == counts["all"] - embedding
    # tied (the 1B shape): the head's products count although its table is the embedding's
    tied = {k: v for k, v in SHAPES["llama3.2-1b"].items() if k not in ("architectures", "model_type")}
    assert matmul_parameters(SHAPES["llama3.2-1b"]) == _hf_parameters(tied)["all"]


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
    got = throughput_flops(shape, requests, input_len, output_len)
    assert got == pytest.approx(expected + attention, rel=1e-4)


def test_decode_kv_reads_at_the_8b_shape() -> None:
    """1,000 x (512 in / 128 out) in bf16: 127 decode steps a request, over 513..639 positions,
    each position 32 layers x 8 KV heads x 128 x K and V x 2 bytes = 131,072 bytes."""
    shape = SHAPES["llama3-8b"]
    head_dim = shape["hidden_size"] // shape["num_attention_heads"]
    per_token = 2 * shape["num_hidden_layers"] * shape["num_key_value_heads"] * head_dim * 2
    assert per_token == 131_072
    assert decode_kv_read_bytes(per_token, 1000, 512, 128) == 1000 * sum(range(513, 640)) * 131_072
    assert decode_kv_read_bytes(per_token, 1000, 512, 1) == 0  # the one token comes from the prompt


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
            "--bandwidth-gbs",
            "2",
        )
    )
    (line,) = [json.loads(s) for s in capsys.readouterr().out.splitlines() if s.startswith("{")]
    assert (line["bench"], line["output_tokens"], line["input_tokens"]) == ("throughput", 12, 24)
    config = json.loads((path / "config.json").read_text())
    bound = throughput_flops(config, 3, 8, 4) / 0.5e12
    assert line["flop_bound_s"] == pytest.approx(bound)
    assert line["fraction_of_flop_bound"] == pytest.approx(bound / line["seconds"])
    # the decode steps' KV reads: outputs 2..4 of each request attend over 9, 10 and 11
    # positions, K and V rows of every layer's KV heads, float32
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    row = 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * head_dim * 4
    assert line["decode_kv_read_bytes"] == 3 * (9 + 10 + 11) * row
    floor = bound + line["decode_kv_read_bytes"] / 2e9
    assert line["flop_and_kv_floor_s"] == pytest.approx(floor)
    assert line["fraction_of_flop_and_kv_floor"] == pytest.approx(floor / line["seconds"])
    # where the time went: the 3 prompts' 24 tokens in prefill steps, the decodes in the rest
    prefill, decode = line["breakdown"]["prefill"], line["breakdown"]["decode"]
    assert prefill["prompt_tokens"] == 24 and prefill["steps"] >= 1 and decode["prompt_tokens"] == 0
    assert prefill["decode_rows"] + decode["decode_rows"] == 3 * (4 - 1)  # (the first token: prefill)
    assert decode["tokens"] == decode["decode_rows"] > 0
    assert 0 < prefill["seconds"] + decode["seconds"] <= line["seconds"]
    assert (line["peak_running"], line["preemptions"]) == (3, 0)
    # the engine thread's time a step by part, within the run's wall time a step
    host = line["host_ms_per_step"]
    assert set(host) == {"schedule", "launch", "wait", "sample", "update", "gc"}
    assert host["launch"] > 0 and host["update"] > 0
    parts = sum(v for k, v in host.items() if k != "gc")
    assert 0 < parts <= line["host_wall_ms_per_step"] + 1e-3
    assert line["host_wall_ms_per_step"] * line["steps"] <= 1e3 * line["seconds"] * 1.01


def test_bench_throughput_counts_its_preemptions(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], one_thread: None
) -> None:
    """Three requests of 8 + 12 tokens need two 16-token blocks each; three blocks hold the
    three prompts, so each one's second block is taken from another running request."""
    path = make_tiny_model(tmp_path, "llama")
    flags = ["--model", str(path), "--device", "cpu", "--num-requests", "3", "--input-len", "8",
             "--output-len", "12", "--max-model-len", "64"]  # fmt: skip
    lines = {}
    for blocks in (3, 6):
        cli.run(bench_args("throughput", *flags, "--num-kv-blocks", str(blocks)))
        (line,) = [json.loads(s) for s in capsys.readouterr().out.splitlines() if s.startswith("{")]
        assert line["output_tokens"] == 36
        lines[blocks] = line
    assert lines[3]["preemptions"] > 0 and lines[6]["preemptions"] == 0


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


def _lines(capsys: pytest.CaptureFixture[str]) -> list[dict]:
    return [json.loads(s) for s in capsys.readouterr().out.splitlines() if s.startswith("{")]


def test_bench_latency_takes_a_gguf_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
    one_thread: None,
) -> None:
    """--model FILE.gguf, as `mmserve serve` takes it (its config from the converted folder);
    on the CPU a step reads the file's blocks where the CPU kernels build (the embedding
    table aside: its head is untied), else the weights dequantised to float32."""
    from mmserve.bench.checkpoints import write_checkpoint

    monkeypatch.setenv("MMSERVE_CACHE_DIR", str(tmp_path / "cache"))
    base = tmp_path / "base"
    config = tiny_config(hidden_size=256, intermediate_size=512, head_dim=64)
    config.save_pretrained(base)
    make_tiny_tokenizer().save_pretrained(base)
    path = write_checkpoint(base, "gguf:Q4_0", tmp_path / "gguf", "tiny")
    assert path.suffix == ".gguf" and path.is_file()
    cli.run(bench_args("latency", "--model", str(path), "--device", "cpu", "--input-len", "8",
                       "--output-len", "4", "--max-model-len", "64"))  # fmt: skip
    (line,) = _lines(capsys)
    assert (line["bench"], line["input_len"], line["output_len"]) == ("latency", 8, 4)
    if cpu_lib.available():
        from gguf import GGUFReader

        tensors = GGUFReader(path).tensors
        assert "output.weight" in {t.name for t in tensors}
        expected = sum(int(t.n_bytes) for t in tensors if t.name != "token_embd.weight")
    else:
        expected = 4 * matmul_parameters(json.loads((base / "config.json").read_text()))
    assert line["weight_bytes"] == expected
    assert line["bandwidth_floor_ms"] is None  # (no --bandwidth-gbs on the CPU: no roofline)


def test_bench_decode_gives_a_line_per_batch_size(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], one_thread: None
) -> None:
    """--batch-sizes: one engine, a decode line per size (with latency first when both are
    asked for); --batch-size alone still gives its one line."""
    path = make_tiny_model(tmp_path, "llama")
    flags = ["--model", str(path), "--device", "cpu", "--input-len", "8", "--output-len", "4",
             "--max-model-len", "128"]  # fmt: skip
    cli.run(bench_args("decode,latency", *flags, "--batch-sizes", "1,3", "--bandwidth-gbs", "30"))
    lines = _lines(capsys)
    assert [(x["bench"], x.get("batch_size")) for x in lines] == [
        ("latency", None), ("decode", 1), ("decode", 3),
    ]  # fmt: skip
    weights = 4 * (LAYERS * sum(n * k for n, k in PROJECTIONS) + NORMS + V * H)  # float32
    for line in lines[1:]:
        assert (line["context"], line["weight_bytes"], line["quantization"]) == (8, weights, "")
        kv_per_token = 2 * LAYERS * 2 * 16 * 4  # K and V, 2 heads of 16, float32
        assert line["kv_bytes_read"] == line["batch_size"] * (8 + 32) * kv_per_token
        assert line["roofline_ms"] == pytest.approx(1e3 * (weights + line["kv_bytes_read"]) / 30e9)
    cli.run(bench_args("decode", *flags, "--batch-size", "2", "--decode-context", "12"))
    (line,) = _lines(capsys)
    assert (line["batch_size"], line["context"]) == (2, 12)
    assert line["roofline_ms"] is None  # on the CPU no bandwidth is assumed


def test_bench_kinds_and_checkpoint_formats_are_checked() -> None:
    with pytest.raises(SystemExit):
        bench_args("latency,embed")  # embed runs an engine of its own
    assert bench_args("throughput,latency").kind == "latency,throughput"
    with pytest.raises(ValueError, match="--checkpoint-format writes a random checkpoint of a shape"):
        cli.run(bench_args("latency", "--model", "/no/such/model", "--checkpoint-format", "w4a16-g128"))


def test_bench_loads_a_shapes_checkpoint_in_a_format(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
    one_thread: None,
) -> None:
    """--checkpoint-format: the shape's checkpoint written (once) and loaded as it is, INT8
    w8a8 here: a step reads a byte per weight, a float32 scale per channel, and on the CPU
    float32 norms and head (the tiny shape's vocabulary is Llama 3's)."""
    monkeypatch.setenv("MMSERVE_CACHE_DIR", str(tmp_path / "cache"))
    cli.run(bench_args("latency", "--model", "shape:llama3-tiny", "--checkpoint-format", "w8a8-int8",
                       "--device", "cpu", "--input-len", "8", "--output-len", "2",
                       "--max-model-len", "64"))  # fmt: skip
    (line,) = _lines(capsys)
    shape = SHAPES["llama3-tiny"]
    h, vocab = shape["hidden_size"], shape["vocab_size"]
    projections = [(256, 256), (128, 256), (128, 256), (256, 256), (512, 256), (512, 256), (256, 512)]
    weights = 2 * sum(n * k + 4 * n for n, k in projections)
    assert line["quantization"] == "w8a8-int8"
    assert line["weight_bytes"] == weights + 4 * (2 * 2 * h + h + vocab * h)
    assert len(list((tmp_path / "cache" / "bench-checkpoints").iterdir())) == 1


def test_steps_breakdown_times_each_plan_from_the_landing_before() -> None:
    """A plan's time runs from the plan before it landing (or the start) to its own."""
    from mmserve.bench.offline import steps_breakdown
    from mmserve.engine.sched_output import ScheduledRequest, SchedulerOutput
    from mmserve.params import SamplingParams

    def plan(prompt_len: int, start: int, n: int) -> SchedulerOutput:
        request = ScheduledRequest("r", [1] * n, start, [], True, SamplingParams(), [1] * prompt_len, [], frozenset())
        return SchedulerOutput(scheduled=[request])

    landed = [(plan(8, 0, 8), 1.0), (SchedulerOutput(), 1.5), (plan(8, 8, 1), 3.0), (plan(8, 9, 1), 6.0)]
    got = steps_breakdown(landed, start=0.0)  # a prefill, an empty step, two decodes
    assert (got["prefill"]["seconds"], got["decode"]["seconds"]) == (1.0, 4.5)
    assert got["prefill"]["prompt_tokens"] == 8 and got["decode"]["steps"] == 2
    assert got["decode"]["decode_rows"] == 2 and got["prefill"]["decode_rows"] == 0


def test_bench_profile_covers_a_prefill_and_decode_steps(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
    one_thread: None,
) -> None:
    """MMSERVE_BENCH_PROFILE: `bench prefill` appends a profile of one untimed prefill and
    `bench decode` one of five decode steps, each under its title, ops by time."""
    profile = tmp_path / "profile.txt"
    monkeypatch.setenv("MMSERVE_BENCH_PROFILE", str(profile))
    path = make_tiny_model(tmp_path, "llama")
    flags = ["--model", str(path), "--device", "cpu", "--input-len", "8", "--max-model-len", "128"]
    cli.run(bench_args("prefill", *flags, "--batch-size", "2"))
    cli.run(bench_args("decode", *flags, "--batch-size", "2", "--output-len", "4"))
    text = profile.read_text()
    assert text.index("# a prefill of 2 x 8 tokens") < text.index("# 5 decode steps at batch 2")
    assert text.count("aten::") > 10  # the ops' tables
    capsys.readouterr()
