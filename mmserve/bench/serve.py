"""`mmserve bench serve`: a gRPC load generator in the manner of vLLM's serving benchmark.

Requests arrive as a Poisson process (gamma intervals with --burstiness != 1) at each
--request-rate in turn (inf = all at once), stream through the SDK's AsyncClient, and each
rate prints one JSON line: request and token throughput, TTFT, TPOT, ITL and end-to-end
latency (mean, median, p99, in ms), and goodput (requests/s meeting every SLO given), as
defined in serve_metrics.py.

The target is a running server on this machine (--target host:port) or one started here on a
free loopback port (--model PATH or shape:NAME, random weights), with the load generator in a
process of its own. Every rate is bounded: at most --num-requests requests and --max-duration-s
seconds, after which calls still running are cancelled and counted as failed. Each rate has its own cache_salt, so no rate reuses the
prefix cache of another (or of the warm-up).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ipaddress
import json
import math
import multiprocessing
import random
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mmserve.bench.serve_metrics import RequestResult, summarize

SERVED_NAME = "bench-model"  # the model's name on a server this benchmark starts


@dataclass(frozen=True)
class Prompt:
    source: str | list[int]  # raw text (no chat template) or token ids
    output_len: int  # tokens to generate (ignore_eos + min_tokens make it exact)


# (flag, type, default, help) of the options only `bench serve` reads; --model, --input-len,
# --output-len, --num-requests and the engine flags are shared with the other kinds.
_FLAGS: list[tuple[str, Any, Any, str]] = [
    ("--target", str, None, "host:port of a running server on this machine (loopback only); "
     + "--model is then the served name (default: the server's generating model)"),
    ("--request-rate", str, None, "requests/s, repeatable or comma-separated; inf = all at once"),
    ("--burstiness", float, 1.0, "gamma shape of the arrival intervals; 1 = Poisson"),
    ("--max-concurrency", int, None, "cap on requests in flight (default none)"),
    ("--prompt-file", str, None, "text prompts, one per line (default: random token ids)"),
    ("--range-ratio", float, 0.0, "lengths drawn from len * [1 - r, 1 + r] (default 0)"),
    ("--slo-ttft-ms", float, None, "goodput's TTFT SLO (default none)"),
    ("--slo-tpot-ms", float, None, "goodput's TPOT SLO (default none)"),
    ("--max-duration-s", float, 600.0, "time bound of each rate; later calls are cancelled"),
    ("--num-warmup", int, 1, "untimed requests before the first rate"),
    ("--seed", int, 0, "of the prompts and the arrival times"),
]  # fmt: skip


def add_arguments(p: argparse.ArgumentParser) -> None:
    for flag, kind, default, text in _FLAGS:
        action = "append" if flag == "--request-rate" else "store"
        p.add_argument(flag, type=kind, default=default, action=action, help=f"serve: {text}")
    p.add_argument(
        "--metrics",
        action="store_true",
        help="serve: the local server exports Prometheus metrics (as --metrics-port does, on a "
        "free port), to measure what they cost",
    )


def parse_rates(values: list[str] | None) -> list[float]:
    """['1,4', 'inf'] -> [1.0, 4.0, inf]; each rate must be > 0."""
    rates = [float(v) for text in values or ["inf"] for v in text.split(",") if v.strip()]
    if not rates or any(not r > 0 for r in rates):
        raise ValueError(f"--request-rate: give rates > 0 or inf, got {values}")
    return rates


def loopback_target(target: str) -> str:
    """The target unchanged if its host is this machine; else ValueError naming --target."""
    host, sep, port = target.rpartition(":")
    host = host.strip("[]")
    if not sep or not port.isdigit():
        raise ValueError(f"--target: expected host:port, got {target!r}")
    with contextlib.suppress(ValueError):
        if host == "localhost" or ipaddress.ip_address(host).is_loopback:
            return target
    raise ValueError(f"--target must be a loopback address (127.0.0.1, ::1, localhost): {target!r}")


def make_prompts(args: argparse.Namespace, vocab_size: int) -> list[Prompt]:
    """--num-requests prompts, random token ids of about --input-len or lines of --prompt-file
    (cycled), each with an output length of about --output-len."""
    rng = random.Random(args.seed)

    def length(n: int) -> int:
        return max(1, round(n * rng.uniform(1 - args.range_ratio, 1 + args.range_ratio)))

    texts = Path(args.prompt_file).read_text().splitlines() if args.prompt_file else []
    texts = [t for t in texts if t.strip()]
    if args.prompt_file and not texts:
        raise ValueError(f"--prompt-file {args.prompt_file}: no prompts in it")
    prompts = []
    for i in range(args.num_requests):
        if texts:
            source: str | list[int] = texts[i % len(texts)]
        else:  # away from the ends of the vocabulary, where special tokens usually sit
            low, high = (100, vocab_size - 100) if vocab_size > 300 else (0, vocab_size)
            source = [rng.randrange(low, high) for _ in range(length(args.input_len))]
        prompts.append(Prompt(source, length(args.output_len)))
    return prompts


async def send(client: Any, prompt: Prompt, model: str, salt: str, timeout: float) -> RequestResult:
    """One streamed Generate call, timed chunk by chunk."""
    from mmserve_client import MMServeError

    n, result = prompt.output_len, RequestResult(ok=False)
    start = last = time.perf_counter()
    try:
        stream = client.generate_stream(
            prompt.source,
            model=model,
            max_tokens=n,
            min_tokens=n,
            ignore_eos=True,
            temperature=0.0,
            cache_salt=salt,
            timeout=timeout,
        )
        async with stream:
            async for chunk in stream:
                now = time.perf_counter()
                if chunk.token_ids:
                    if result.output_tokens == 0:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    last = now
                    result.output_tokens += len(chunk.token_ids)
                if chunk.usage is not None:
                    result.prompt_tokens = chunk.usage.prompt_tokens
    except MMServeError as e:
        result.error = f"{e.code.name}: {e}"
        return result
    result.latency, result.ok = time.perf_counter() - start, result.output_tokens > 0
    result.error = "" if result.ok else "no tokens"
    return result


async def run_rate(
    client: Any, prompts: list[Prompt], rate: float, args: argparse.Namespace, model: str, salt: str
) -> tuple[list[RequestResult], float]:
    """Sends the prompts at `rate` (absolute arrival times, so sleeps do not drift); returns
    one result per prompt sent or not (not sent or cut off by the time bound: failed) and the
    seconds from the first send to the last answer."""
    rng = random.Random(args.seed + 1)
    limit = asyncio.Semaphore(args.max_concurrency or len(prompts))
    timeout = args.max_duration_s

    async def limited(prompt: Prompt) -> RequestResult:
        async with limit:
            return await send(client, prompt, model, salt, timeout)

    start = time.perf_counter()
    deadline, due = start + args.max_duration_s, start
    tasks: list[asyncio.Task[RequestResult]] = []
    for i, prompt in enumerate(prompts):
        if i and math.isfinite(rate):
            due += rng.gammavariate(args.burstiness, 1.0 / (rate * args.burstiness))
            await asyncio.sleep(max(0.0, due - time.perf_counter()))
        if time.perf_counter() >= deadline:
            break
        tasks.append(asyncio.create_task(limited(prompt)))
    if tasks:
        _, pending = await asyncio.wait(tasks, timeout=max(0.0, deadline - time.perf_counter()))
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    duration = time.perf_counter() - start
    cut = RequestResult(ok=False, error="time bound (--max-duration-s)")
    results = [cut if t.cancelled() else t.result() for t in tasks]
    return results + [cut] * (len(prompts) - len(tasks)), duration


async def bench(args: argparse.Namespace, target: str, model: str, rate: float, salt: str) -> str:
    """One rate against the target, after a short warm-up: its JSON line."""
    from mmserve_client import AsyncClient

    async with AsyncClient(target, retry_attempts=1) as client:
        await client.wait_ready(60)
        models = [m for m in await client.list_models(model=model) if "generate" in m.tasks]
        if not models:
            raise ValueError(f"bench serve: no model on {target} can generate")
        prompts = make_prompts(args, models[0].vocab_size)
        for p in prompts[: args.num_warmup]:
            await send(client, Prompt(p.source, min(p.output_len, 4)), model, salt + "-warmup", 60)
        results, duration = await run_rate(client, prompts, rate, args, model, salt)
    line = {
        "bench": "serve",
        "target": target,
        "model": model or models[0].name,
        "request_rate": "inf" if math.isinf(rate) else rate,
        "burstiness": args.burstiness,
        "max_concurrency": args.max_concurrency,
        "num_requests": len(prompts),
        "input_len": None if args.prompt_file else args.input_len,
        "output_len": args.output_len,
        "metrics": bool(getattr(args, "metrics", False)),
        **summarize(results, duration, args.slo_ttft_ms, args.slo_tpot_ms),
    }
    return json.dumps(line)


def bench_in_this_process(
    args: argparse.Namespace, target: str, model: str, rate: float, salt: str
) -> str:
    return asyncio.run(bench(args, target, model, rate, salt))


@contextlib.contextmanager
def local_server(args: argparse.Namespace) -> Iterator[str]:
    """A server of --model on a free loopback port, on its own event-loop thread."""

    from mmserve.bench.engine_flags import engine_config
    from mmserve.bench.models import model_folder
    from mmserve.server.config import ModelSpec, ServerConfig
    from mmserve.server.grpc_server import MMServer
    from mmserve.server.models import ModelRegistry, load_model

    started = time.perf_counter()
    folder, dummy = model_folder(args.model, args.load_format)
    pending = args.num_requests + args.num_warmup
    metrics_port = 0 if getattr(args, "metrics", False) else None
    config = ServerConfig(host="127.0.0.1", port=0, max_pending=pending, metrics_port=metrics_port)
    template = engine_config(args, "", dummy, bool(getattr(args, "engine_process", False)))
    handle = load_model(ModelSpec(SERVED_NAME, str(folder)), template, pending)
    server = MMServer(ModelRegistry([handle]), config)
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True, name="bench-server")
    thread.start()
    try:
        port = asyncio.run_coroutine_threadsafe(server.start(), loop).result(60)
        # the start-up's cost (load, CUDA graphs, the warm-up: compare --warmup / --no-warmup)
        start_s = time.perf_counter() - started
        print(json.dumps({"bench": "serve-start", "start_s": round(start_s, 2), "warmup": getattr(args, "warmup", None)}), flush=True)
        yield f"127.0.0.1:{port}"
    finally:
        asyncio.run_coroutine_threadsafe(server.drain(grace=5.0), loop).result(60)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)


def run(args: argparse.Namespace) -> None:
    rates = parse_rates(args.request_rate)
    if args.num_requests < 1:
        raise ValueError("--num-requests must be >= 1")
    run_id = uuid.uuid4().hex[:8]  # cache_salt prefix: no rate hits another's prefix cache
    if args.target:
        target = loopback_target(args.target)
        for i, rate in enumerate(rates):
            line = bench_in_this_process(args, target, args.model or "", rate, f"{run_id}-{i}")
            print(line, flush=True)
        return
    if not args.model:
        raise ValueError("bench serve: give --target HOST:PORT or --model PATH|shape:NAME")
    # The load generator gets a process of its own (as vLLM's does): in the server's process
    # it would contend for the GIL with the front end and skew what it measures.
    client_args = argparse.Namespace(**{k: v for k, v in vars(args).items() if k != "func"})
    spawn = multiprocessing.get_context("spawn")
    with local_server(args) as target, ProcessPoolExecutor(1, mp_context=spawn) as client:
        for i, rate in enumerate(rates):
            salt = f"{run_id}-{i}"
            result = client.submit(
                bench_in_this_process, client_args, target, SERVED_NAME, rate, salt
            )
            print(result.result(), flush=True)
