"""`mmserve bench latency | throughput | decode | prefill | embed | serve | structured | spec |
spec-cost`: engine benchmarks (embed also over gRPC, against sentence-transformers:
mmserve/bench/embed.py; serve is a gRPC load generator with Poisson arrivals:
mmserve/bench/serve.py; structured is the cost of constrained decoding:
mmserve/bench/structured.py; spec and spec-cost are speculative decoding's gain and cost:
mmserve/bench/speculative.py).

Each prints one JSON object per line (the figure, its roofline where one applies, and the
transformers baseline when --baseline is given), so results can be pasted into BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from mmserve import envs
from mmserve.bench import embed, offline, serve, soak, speculative, structured, vlm
from mmserve.bench.engine_flags import add_engine_flags, engine_config
from mmserve.bench.models import model_folder
from mmserve.bench.roofline import prefill_flops, step_weight_bytes, throughput_flops
from mmserve.frontend.frontend import FrontEnd

# measured on the H200 (issue 5; BENCHMARKS.md): bf16 matmul at 8192^3, and torch._scaled_mm
# with row-wise FP8 scales on Llama-3-8B's projections at 1k-16k rows
BF16_MATMUL_TFLOPS = 800.0
FP8_MATMUL_TFLOPS = 1300.0


def add_parser(sub: Any) -> None:
    p = sub.add_parser("bench", help="benchmarks (offline engine)")
    kinds = [
        "latency", "throughput", "decode", "prefill", "embed", "serve", "structured", "vlm", "soak",
        "spec", "spec-cost",
    ]
    p.add_argument("kind", choices=kinds)
    p.add_argument(
        "--model",
        default=None,
        help="a model path, or shape:NAME with random weights "
        "(default shape:llama3-8b; shape:bert-base for embed)",
    )
    p.add_argument("--load-format", default=None, choices=["auto", "dummy"],
                   help="dummy = random weights (default for shape:NAME)")
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--num-requests", type=int, default=1000)
    p.add_argument("--batch-size", type=int, default=64)
    add_engine_flags(p)  # --device, --dtype, --max-num-seqs, ... --no-async-scheduling
    p.add_argument("--engine-process", action="store_true",
                   help="serve, embed: run the (gRPC side's) engine core in its own process "
                        "(as `mmserve serve` on CUDA; embed does so on CUDA anyway)")
    p.add_argument("--bandwidth-gbs", type=float, default=4180.0, help="measured copy bandwidth, for the roofline")
    p.add_argument("--matmul-tflops", type=float, default=None,
                   help="measured matmul rate for throughput's FLOP bound (default: the H200's, "
                        f"{BF16_MATMUL_TFLOPS:.0f} bf16, {FP8_MATMUL_TFLOPS:.0f} with --quantization fp8)")
    p.add_argument("--baseline", action="store_true", help="also time transformers generate")
    embed.add_arguments(p)
    serve.add_arguments(p)
    structured.add_arguments(p)
    vlm.add_arguments(p)
    soak.add_arguments(p)
    speculative.add_arguments(p)
    p.set_defaults(func=run)


def _engine(args: argparse.Namespace, folder: Path, dummy: bool) -> FrontEnd:
    return FrontEnd.start(engine_config(args, str(folder), dummy))


def _emit(**fields: Any) -> None:
    print(json.dumps(fields), flush=True)


def run(args: argparse.Namespace) -> None:
    if args.kind == "embed":
        embed.run(args)
        return
    if args.kind == "serve":
        serve.run(args)
        return
    if args.kind == "structured":
        structured.run(args)
        return
    if args.kind == "vlm":
        vlm.run(args)
        return
    if args.kind == "soak":
        soak.run(args)
        return
    if args.kind in ("spec", "spec-cost"):
        run_spec = speculative.run if args.kind == "spec" else speculative.run_cost
        run_spec(args, _emit, speculative.engine_factory(args))
        return
    args.model = args.model or "shape:llama3-8b"
    folder, dummy = model_folder(args.model, args.load_format)
    config = json.loads((folder / "config.json").read_text())
    if args.baseline:  # first, and freed after: both cannot hold the GPU's memory at once
        _baseline(args, folder, dummy, config)
    engine = _engine(args, folder, dummy)
    llama = config.get("model_type") in ("llama", "mistral", "qwen2")
    wbytes = step_weight_bytes(engine.core.runner.model) if llama else None  # as loaded
    bw = args.bandwidth_gbs * 1e9
    if args.kind == "latency":
        lat = offline.latency(engine, args.input_len, args.output_len)
        floor_ms = 1e3 * wbytes / bw if wbytes else None
        _emit(bench="latency", **asdict(lat), weight_bytes=wbytes, bandwidth_floor_ms=floor_ms,
              fraction_of_roofline=floor_ms / lat.decode_ms_median if floor_ms else None)
    elif args.kind == "decode":
        ms, kv_bytes = decode_step_ms(engine, args.batch_size, args.input_len)
        floor_ms = 1e3 * ((wbytes or 0) + kv_bytes) / bw
        _emit(bench="decode", batch_size=args.batch_size, context=args.input_len, step_ms=ms,
              kv_bytes_read=kv_bytes, roofline_ms=floor_ms, ratio_to_roofline=ms / floor_ms)
    elif args.kind == "prefill":
        ms, _ = prefill_ms(engine, args.batch_size, args.input_len)
        flops = prefill_flops(config, args.batch_size, args.input_len) if wbytes else None
        _emit(bench="prefill", batch_size=args.batch_size, input_len=args.input_len, step_ms=ms,
              tflops=flops / ms / 1e9 if flops else None)
    else:
        r = offline.throughput(engine, args.num_requests, args.input_len, args.output_len)
        # the matmuls of every request's whole sequence, at the measured matmul rate
        flops = throughput_flops(config, args.num_requests, args.input_len, args.output_len) if wbytes else None
        tflops = args.matmul_tflops or (FP8_MATMUL_TFLOPS if args.quantization == "fp8" else BF16_MATMUL_TFLOPS)
        bound_s = flops / (tflops * 1e12) if flops else None
        _emit(bench="throughput", **asdict(r), output_tokens_per_s=r.output_tokens_per_s,
              total_tokens_per_s=r.total_tokens_per_s, matmul_tflops=tflops, flop_bound_s=bound_s,
              fraction_of_flop_bound=bound_s / r.seconds if bound_s else None)


def decode_step_ms(engine: FrontEnd, batch: int, context: int) -> tuple[float, int]:
    """Median time of a decode step with `batch` requests at about `context` tokens each."""
    import random

    rng = random.Random(0)
    params = offline._fixed_length(64)
    for i in range(batch):
        engine.add_request(f"dec-{i}", offline.random_prompt(rng, context, engine.vocab_size), params)
    times: list[float] = []
    while engine.has_unfinished:
        decoding = all(r.num_computed_tokens > 0 for r in engine.core.scheduler.running) and not engine.core.scheduler.waiting
        if decoding and len(times) == 8 and envs.bench_profile_path():
            _profile_steps(engine, 5)
        t = time.perf_counter()
        engine.step()
        if decoding and len(engine.core.scheduler.running) == batch:
            times.append(time.perf_counter() - t)
    model = engine.core.runner.model
    kv_per_token = 2 * model.num_layers * model.num_kv_heads * model.head_dim * engine.core.runner.kv_caches[0].element_size()
    return 1e3 * statistics.median(times[2:]), batch * (context + 32) * kv_per_token


def _profile_steps(engine: FrontEnd, steps: int) -> None:
    """Writes the top kernels and CPU ops of a few decode steps to $MMSERVE_BENCH_PROFILE."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities) as prof:
        for _ in range(steps):
            engine.step()
    path = envs.bench_profile_path()
    assert path is not None
    sort = "cuda_time_total" if torch.cuda.is_available() else "cpu_time_total"
    with open(path, "a") as f:
        f.write(f"# {steps} decode steps at batch {len(engine.core.scheduler.running)}\n")
        f.write(prof.key_averages().table(sort_by=sort, row_limit=25) + "\n")
        f.write(prof.key_averages().table(sort_by="cpu_time_total", row_limit=15) + "\n")


def prefill_ms(engine: FrontEnd, batch: int, input_len: int) -> tuple[float, int]:
    """Time from launching one step that prefills `batch` prompts of input_len tokens together
    to their first tokens on the host."""
    import random

    rng = random.Random(0)
    times = []
    for rep in range(4):
        engine.core.kv.pool.reset_cache()
        for i in range(batch):
            engine.add_request(f"pf-{rep}-{i}", offline.random_prompt(rng, input_len, engine.vocab_size), offline._fixed_length(1))
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t = time.perf_counter()
        while engine.has_unfinished:  # one prefill step (and, async, one to read its tokens)
            engine.step()
        times.append(time.perf_counter() - t)
    return 1e3 * statistics.median(times[1:]), batch * input_len


def _baseline(args: argparse.Namespace, folder: Path, dummy: bool, config: dict) -> None:
    from mmserve.bench.hf_baseline import hf_generate, load_hf_model
    from mmserve.models.loader import resolve_device, resolve_dtype

    device = resolve_device(args.device)
    model = load_hf_model(folder, str(device), resolve_dtype(args.dtype, device), dummy)
    batch = 1 if args.kind == "latency" else min(args.batch_size if args.kind != "throughput" else 128, 128)
    out_len = min(args.output_len, 64) if batch == 1 else args.output_len
    r = hf_generate(model, batch, args.input_len, out_len, config["vocab_size"])
    del model
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    _emit(bench=f"{args.kind}-transformers-generate", **asdict(r), output_tokens_per_s=r.output_tokens_per_s,
          ms_per_step=1e3 * r.seconds / out_len)


def main() -> None:
    parser = argparse.ArgumentParser(prog="mmserve")
    add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args()
    args.func(args)


if __name__ == "__main__":
    main()
