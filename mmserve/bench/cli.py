"""`mmserve bench latency | throughput | decode | prefill | embed | serve | structured | spec |
spec-cost | quality`: engine benchmarks (the first four may be combined, comma-separated, to run in one
engine: `latency,decode,throughput`; embed also over gRPC, against sentence-transformers:
mmserve/bench/embed.py; serve is a gRPC load generator with Poisson arrivals:
mmserve/bench/serve.py; structured is the cost of constrained decoding:
mmserve/bench/structured.py; spec and spec-cost are speculative decoding's gain and cost:
mmserve/bench/speculative.py; quality is what quantisation does to the next-token
distribution on real text: mmserve/bench/quality.py).

Each prints one JSON object per line (the figure, its roofline where one applies, and the
transformers baseline when --baseline is given), so results can be pasted into BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from mmserve import envs
from mmserve.bench import embed, offline, prefix, quality, serve, soak, speculative, structured, vlm
from mmserve.bench.checkpoints import FORMATS, model_path
from mmserve.bench.engine_flags import add_engine_flags, engine_config
from mmserve.bench.models import model_config
from mmserve.bench.offline import parse_batch_sizes
from mmserve.bench.roofline import (
    decode_kv_read_bytes,
    prefill_flops,
    step_weight_bytes,
    throughput_flops,
)
from mmserve.frontend.frontend import FrontEnd
from mmserve.models.gguf_linear import takes_int8_activations

# measured on the H200 (issue 5; BENCHMARKS.md): bf16 matmul at 8192^3, and torch._scaled_mm
# with row-wise FP8 scales on Llama-3-8B's projections at 1k-16k rows
BF16_MATMUL_TFLOPS = 800.0
H200_COPY_GBS = 4180.0  # the H200's measured copy bandwidth
FP8_MATMUL_TFLOPS = 1300.0
# the kinds that share one engine when combined (latency,decode,...), in the order they run
OFFLINE_KINDS = ("latency", "decode", "prefill", "throughput")
KINDS = (*OFFLINE_KINDS, "embed", "serve", "structured", "vlm", "prefix", "soak", "spec",
         "spec-cost", "quality")
# the architectures whose rooflines the config describes (Llama-shaped decoders)
ROOFLINE_MODEL_TYPES = ("llama", "mistral", "qwen2")


def add_parser(sub: Any) -> None:
    p = sub.add_parser("bench", help="benchmarks (offline engine)")
    p.add_argument("kind", type=_kinds, help=f"one of {', '.join(KINDS)}; or several of "
                   f"{', '.join(OFFLINE_KINDS)}, comma-separated, run in that order in one engine")
    p.add_argument(
        "--model",
        default=None,
        help="a model path (an HF folder or a .gguf file), or shape:NAME with random weights "
        "(default shape:llama3-8b; shape:bert-base for embed)",
    )
    p.add_argument("--load-format", default=None, choices=["auto", "dummy"],
                   help="dummy = random weights (default for shape:NAME)")
    p.add_argument("--checkpoint-format", default=None, choices=list(FORMATS),
                   help="latency, throughput, decode, prefill with --model shape:NAME: load a real "
                   "checkpoint of that shape in this format, random contents, written once under "
                   "the cache directory (mmserve/bench/checkpoints.py)")
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--num-requests", type=int, default=1000)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--decode-context", type=int, default=None,
                   help="decode: tokens of context per request (default --input-len; lets "
                   "latency,decode,throughput in one engine give decode its own)")
    add_engine_flags(p)  # --device, --dtype, --max-num-seqs, ... --no-async-scheduling
    p.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=None,
                   help="serve, embed: run the (gRPC side's) engine core in its own process, as "
                        "`mmserve serve` does (default: embed yes, serve no)")
    p.add_argument("--bandwidth-gbs", type=float, default=None,
                   help=f"measured read bandwidth, for the roofline (default: on CUDA the H200's "
                        f"{H200_COPY_GBS:.0f}; on the CPU none, and no roofline)")
    p.add_argument("--matmul-tflops", type=float, default=None,
                   help="measured matmul rate for throughput's FLOP bound (default: on CUDA the "
                        f"H200's, {BF16_MATMUL_TFLOPS:.0f} bf16, {FP8_MATMUL_TFLOPS:.0f} with "
                        "--quantization fp8; on the CPU none, and no bound)")
    p.add_argument("--baseline", action="store_true", help="also time transformers generate")
    p.add_argument("--rounds", type=int, default=1,
                   help="latency, decode, prefill, throughput: run each kind this many times, "
                   "taking turns with the baseline (kept loaded beside the engine: on a GPU it "
                   "takes memory from the KV cache), then print the medians")
    embed.add_arguments(p)
    serve.add_arguments(p)
    structured.add_arguments(p)
    vlm.add_arguments(p)
    prefix.add_arguments(p)
    soak.add_arguments(p)
    speculative.add_arguments(p)
    quality.add_arguments(p)
    p.set_defaults(func=run)


def _kinds(text: str) -> str:
    """KIND, or OFFLINE_KINDS comma-separated (put in the order they run)."""
    kinds = [k.strip() for k in text.split(",") if k.strip()]
    if len(kinds) == 1 and kinds[0] in KINDS:
        return kinds[0]
    if not kinds or any(k not in OFFLINE_KINDS for k in kinds):
        raise argparse.ArgumentTypeError(
            f"{text!r}: one of {', '.join(KINDS)}, or several of {', '.join(OFFLINE_KINDS)}"
        )
    return ",".join(k for k in OFFLINE_KINDS if k in kinds)


def _emit(**fields: Any) -> dict[str, Any]:
    print(json.dumps(fields), flush=True)
    return fields


def run(args: argparse.Namespace) -> None:
    others = {"embed": embed.run, "serve": serve.run, "structured": structured.run, "vlm": vlm.run,
              "prefix": prefix.run, "soak": soak.run, "quality": lambda a: quality.run(a, _emit)}  # fmt: skip
    if args.kind in others:
        others[args.kind](args)
    elif args.kind in ("spec", "spec-cost"):
        run_spec = speculative.run if args.kind == "spec" else speculative.run_cost
        run_spec(args, _emit, speculative.engine_factory(args))
    else:
        run_offline(args, args.kind.split(","))


@dataclass(frozen=True)
class Offline:
    """What each offline kind reads: the engine, the model's config and its rooflines."""

    engine: FrontEnd
    config: dict  # config.json (a GGUF's, from its converted folder)
    weight_bytes: int | None  # read by one decode step (roofline.step_weight_bytes); None: not Llama-shaped
    quantization: str  # as the engine runs it: "fp8", "w4a16-g128", "gguf:Q4_K+Q6_K", "" (a GGUF's
    # products on int8 activations: "gguf:Q4_1+Q8_0 (int8 activations)")


def run_offline(args: argparse.Namespace, kinds: list[str]) -> None:
    """latency, decode, prefill, throughput: each in turn, in one engine; with --rounds N
    (and --baseline) N times, taking turns with the transformers baseline kind by kind, then
    a line per kind of the medians over the rounds."""
    args.model = args.model or "shape:llama3-8b"
    path, dummy = model_path(args.model, args.load_format, args.checkpoint_format)
    _, config = model_config(path)
    baseline = _load_baseline(args, path, dummy) if args.baseline else None
    ours: dict[str, list[dict[str, Any]]] = {k: [] for k in kinds}
    theirs: dict[str, list[dict[str, Any]]] = {k: [] for k in kinds}
    if baseline is not None and args.rounds == 1:  # first, and freed: a GPU cannot hold both
        for kind in kinds:
            theirs[kind].append(_baseline(args, kind, baseline, config))
        baseline = None
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    engine = FrontEnd.start(engine_config(args, str(path), dummy))
    llama = config.get("model_type") in ROOFLINE_MODEL_TYPES
    wbytes = step_weight_bytes(engine.core.runner.model) if llama else None
    quantization = engine.info.quantization
    if takes_int8_activations(engine.core.runner.model):  # (--cpu-gguf-activations int8 took)
        quantization += " (int8 activations)"
    bench = Offline(engine, config, wbytes, quantization)
    runners = {"latency": _latency, "decode": _decode, "prefill": _prefill, "throughput": _throughput}
    for _ in range(args.rounds):
        for kind in kinds:
            if baseline is not None:
                theirs[kind].append(_baseline(args, kind, baseline, config))
            ours[kind].append(runners[kind](bench, args))
    if args.rounds > 1 or args.baseline:
        for kind in kinds:
            _summary(kind, ours[kind], theirs[kind])


def _summary(kind: str, ours: list[dict[str, Any]], theirs: list[dict[str, Any]]) -> None:
    """Medians over the rounds of mmserve's figure and the baseline's alike one: the decode
    step at batch 1 (latency), output tokens per second (throughput)."""
    field = {"latency": "decode_ms_median", "throughput": "output_tokens_per_s"}.get(kind)
    if field is None:
        return
    base_field = "decode_ms_per_step" if kind == "latency" else "output_tokens_per_s"
    mine = statistics.median(r[field] for r in ours)
    line: dict[str, Any] = {"bench": f"{kind}-summary", "rounds": len(ours), field: mine}
    if theirs:
        base = statistics.median(r[base_field] for r in theirs)
        speedup = base / mine if kind == "latency" else mine / base
        line.update({f"transformers_{base_field}": base, "speedup_over_transformers": speedup})
    _emit(**line)


def _limits(b: Offline, args: argparse.Namespace) -> tuple[float | None, float | None]:
    """(GB/s, TFLOP/s) the rooflines are drawn at: the flags, else the H200's on CUDA; on the
    CPU none unless given (a machine's own limits are not known here)."""
    cuda = b.engine.info.device.startswith("cuda")
    bandwidth = args.bandwidth_gbs or (H200_COPY_GBS if cuda else None)
    return bandwidth, args.matmul_tflops or (matmul_tflops(b.quantization) if cuda else None)


def _latency(b: Offline, args: argparse.Namespace) -> dict[str, Any]:
    lat = offline.latency(b.engine, args.input_len, args.output_len)
    gbs, _ = _limits(b, args)
    floor_ms = 1e3 * b.weight_bytes / (gbs * 1e9) if b.weight_bytes and gbs else None
    return _emit(bench="latency", **asdict(lat), quantization=b.quantization,
                 weight_bytes=b.weight_bytes, bandwidth_floor_ms=floor_ms,
                 fraction_of_roofline=floor_ms / lat.decode_ms_median if floor_ms else None)  # fmt: skip


def _decode(b: Offline, args: argparse.Namespace) -> dict[str, Any]:
    """One line per batch size (--batch-sizes, else --batch-size), the roofline the weights
    and the KV cache read once."""
    context = args.decode_context or args.input_len
    line: dict[str, Any] = {}
    gbs, _ = _limits(b, args)
    for batch in parse_batch_sizes(args.batch_sizes) if args.batch_sizes else [args.batch_size]:
        ms, kv_bytes = decode_step_ms(b.engine, batch, context)
        floor_ms = 1e3 * ((b.weight_bytes or 0) + kv_bytes) / (gbs * 1e9) if gbs else None
        line = _emit(bench="decode", batch_size=batch, context=context, step_ms=ms,
                     quantization=b.quantization, weight_bytes=b.weight_bytes,
                     kv_bytes_read=kv_bytes, roofline_ms=floor_ms,
                     ratio_to_roofline=ms / floor_ms if floor_ms else None)  # fmt: skip
    return line  # the last batch size's


def _prefill(b: Offline, args: argparse.Namespace) -> dict[str, Any]:
    ms, _ = prefill_ms(b.engine, args.batch_size, args.input_len)
    flops = prefill_flops(b.config, args.batch_size, args.input_len) if b.weight_bytes else None
    return _emit(bench="prefill", batch_size=args.batch_size, input_len=args.input_len,
                 step_ms=ms, quantization=b.quantization,
                 tflops=flops / ms / 1e9 if flops else None)  # fmt: skip


def _throughput(b: Offline, args: argparse.Namespace) -> dict[str, Any]:
    r = offline.throughput(b.engine, args.num_requests, args.input_len, args.output_len)
    # the matmuls of every request's whole sequence, at the measured matmul rate
    flops = (
        throughput_flops(b.config, args.num_requests, args.input_len, args.output_len)
        if b.weight_bytes else None
    )  # fmt: skip
    gbs, tflops = _limits(b, args)
    bound_s = flops / (tflops * 1e12) if flops and tflops else None
    # the decode steps' attention reads their KV rows beside (not under) the products' FLOPs
    kv_bytes = decode_kv_read_bytes(
        kv_bytes_per_token(b.engine), args.num_requests, args.input_len, args.output_len
    ) if b.weight_bytes else None  # fmt: skip
    floor_s = bound_s + kv_bytes / (gbs * 1e9) if bound_s and kv_bytes is not None and gbs else None
    return _emit(bench="throughput", **asdict(r), quantization=b.quantization,
                 output_tokens_per_s=r.output_tokens_per_s,
                 total_tokens_per_s=r.total_tokens_per_s, matmul_tflops=tflops,
                 flop_bound_s=bound_s,
                 fraction_of_flop_bound=bound_s / r.seconds if bound_s else None,
                 decode_kv_read_bytes=kv_bytes, flop_and_kv_floor_s=floor_s,
                 fraction_of_flop_and_kv_floor=floor_s / r.seconds if floor_s else None)  # fmt: skip


def matmul_tflops(quantization: str) -> float:
    """The measured matmul rate the products of a format run at: FP8's for FP8 and for INT8
    w8a8 (Hopper's int8 tensor-core peak is FP8's; int8's own rate is not measured yet), bf16's
    for the rest (weight-only formats multiply in bf16)."""
    return FP8_MATMUL_TFLOPS if quantization in ("fp8", "w8a8-int8") else BF16_MATMUL_TFLOPS


def decode_step_ms(engine: FrontEnd, batch: int, context: int) -> tuple[float, int]:
    """Median time of a decode step with `batch` requests at about `context` tokens each."""
    import random

    rng = random.Random(0)
    params = offline._fixed_length(64)
    engine.core.kv.pool.reset_cache()  # (an earlier batch size's prompts are these' prefixes)
    for i in range(batch):
        prompt = offline.random_prompt(rng, context, engine.vocab_size)
        engine.add_request(f"dec-{batch}-{i}", prompt, params)
    times: list[float] = []
    while engine.has_unfinished:
        decoding = all(r.num_computed_tokens > 0 for r in engine.core.scheduler.running) and not engine.core.scheduler.waiting
        if decoding and len(times) == 8 and envs.bench_profile_path():
            _profile(f"5 decode steps at batch {batch}", lambda: [engine.step() for _ in range(5)])
        t = time.perf_counter()
        engine.step()
        if decoding and len(engine.core.scheduler.running) == batch:
            times.append(time.perf_counter() - t)
    return 1e3 * statistics.median(times[2:]), batch * (context + 32) * kv_bytes_per_token(engine)


def kv_bytes_per_token(engine: FrontEnd) -> int:
    """The KV cache's bytes for one position: K and V of every layer's KV heads."""
    model, cache = engine.core.runner.model, engine.core.runner.kv_caches[0]
    return 2 * model.num_layers * model.num_kv_heads * model.head_dim * cache.element_size()


def _profile(title: str, steps: Callable[[], object]) -> None:
    """Writes the top kernels and CPU ops of what steps() runs to $MMSERVE_BENCH_PROFILE."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities) as prof:
        steps()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    path = envs.bench_profile_path()
    assert path is not None
    sort = "cuda_time_total" if torch.cuda.is_available() else "cpu_time_total"
    with open(path, "a") as f:
        f.write(f"# {title}\n")
        f.write(prof.key_averages().table(sort_by=sort, row_limit=25) + "\n")
        f.write(prof.key_averages().table(sort_by="cpu_time_total", row_limit=15) + "\n")


def prefill_ms(engine: FrontEnd, batch: int, input_len: int) -> tuple[float, int]:
    """Time from launching one step that prefills `batch` prompts of input_len tokens together
    to their first tokens on the host."""
    import random

    rng = random.Random(0)
    times = []

    def prefill(rep: int) -> None:
        engine.core.kv.pool.reset_cache()
        for i in range(batch):
            engine.add_request(f"pf-{rep}-{i}", offline.random_prompt(rng, input_len, engine.vocab_size), offline._fixed_length(1))
        while engine.has_unfinished:  # one prefill step (and, async, one to read its tokens)
            engine.step()

    for rep in range(4):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t = time.perf_counter()
        prefill(rep)
        times.append(time.perf_counter() - t)
    if envs.bench_profile_path():  # (after the timed ones: kernels compiled, not timed)
        _profile(f"a prefill of {batch} x {input_len} tokens", lambda: prefill(4))
    return 1e3 * statistics.median(times[1:]), batch * input_len


def _load_baseline(args: argparse.Namespace, path: Path, dummy: bool) -> torch.nn.Module:
    """transformers' model of the same checkpoint (a GGUF dequantised), in the same dtype."""
    from mmserve.bench.hf_baseline import load_hf_model
    from mmserve.models.loader import resolve_device, resolve_dtype

    device = resolve_device(args.device)
    folder, _ = model_config(path, weights=not dummy)
    return load_hf_model(folder, str(device), resolve_dtype(args.dtype, device), dummy)


def _baseline(
    args: argparse.Namespace, kind: str, model: torch.nn.Module, config: dict
) -> dict[str, Any]:
    """transformers' generate for one kind: batch 1 for latency, as many prompts as the
    engine runs at once for throughput (--num-requests up to --max-num-seqs, at most 128),
    --batch-size for the others."""
    from mmserve.bench.hf_baseline import hf_generate

    if kind == "latency":
        batch = 1
    elif kind == "throughput":
        batch = min(args.num_requests, args.max_num_seqs, 128)
    else:
        batch = min(args.batch_size, 128)
    out_len = min(args.output_len, 64) if batch == 1 else args.output_len
    r = hf_generate(model, batch, args.input_len, out_len, config["vocab_size"])
    line = {"bench": f"{kind}-transformers-generate", **asdict(r),
            "output_tokens_per_s": r.output_tokens_per_s, "ms_per_step": 1e3 * r.seconds / out_len,
            "decode_ms_per_step": r.decode_ms_per_step}  # fmt: skip
    _emit(**line)
    return line


def main() -> None:
    parser = argparse.ArgumentParser(prog="mmserve")
    add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args()
    args.func(args)


if __name__ == "__main__":
    main()
