"""`mmserve bench soak`: mixed traffic against a server for --duration-s, watching for leaks.

The server (this process) hosts the embedded defaults, SmolLM2 for chat and MiniLM for
embeddings (or --chat-model / --embed-model, shape:NAME for random weights, as on a GPU with
no model files), plus --model if given (a model that reads images gets image chats); the load
generator runs in a process of its own, --soak-concurrency callers each keeping one call in
flight: Generate with n 1 or 3, Embed, Rerank, a JSON-schema constrained chat, image chats on
models that take them, 10% of streams cancelled after their first chunk and 5% invalid
requests (each must be refused INVALID_ARGUMENT). Every --report-every-s it prints one JSON
line: resident memory of this process (and of its engine processes), calls by status code,
and whether the canaries (a greedy Generate and an Embed, asked every report) still give
their first answers exactly. At the end, once idle: KV blocks still in use per model (must be
0), and the RSS growth after warm-up (the first report)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import json
import multiprocessing
import os
import random
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

CHAT, EMBED = "chat", "embed"  # the embedded defaults' served names
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
CANARY_PROMPT = "The capital of France is"
CANARY_TEXTS = ["a canary sentence", "another one, longer than the first"]
WORDS = ["the", "a", "cat", "dog", "runs", "fast", "slow", "red", "blue", "model", "server", "token", "cache", "block", "image"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--duration-s", type=float, default=60.0, help="soak: how long the traffic runs")
    p.add_argument("--chat-model", default=None,
                   help="soak: the chat model, a path or shape:NAME (random weights); default SmolLM2")
    p.add_argument("--embed-model", default=None,
                   help="soak: the embedder, a path or shape:NAME; default all-MiniLM-L6-v2")
    p.add_argument("--report-every-s", type=float, default=30.0, help="soak: seconds per report")
    p.add_argument("--soak-concurrency", type=int, default=8, help="soak: callers in flight")


def rss_mb(pid: int | str = "self") -> float:
    """Resident set size of a process in MiB (Linux /proc), 0.0 if it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def _png(seed: int) -> bytes:
    import numpy as np
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (32, 40, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


# -- the load generator (a process of its own) --------------------------------------------


async def _call(client: Any, kind: str, rng: random.Random, vlm: str | None) -> None:
    """One call of `kind`; raises MMServeError as the server answers."""
    text = " ".join(rng.choices(WORDS, k=rng.randint(3, 40)))
    if kind == "generate":
        n = rng.choice([1, 3])
        await client.generate(text, model=CHAT, n=n, max_tokens=rng.randint(4, 32), temperature=0.8, seed=rng.randint(0, 9))
    elif kind == "embed":
        await client.embed([text, text[::-1]], model=EMBED)
    elif kind == "rerank":
        await client.rerank(text, [" ".join(rng.choices(WORDS, k=8)) for _ in range(4)], model=EMBED)
    elif kind == "structured":  # a raw prompt: random-weight chat models have no template
        await client.generate("A person as JSON: " + text, model=CHAT, json_schema=SCHEMA, max_tokens=48)
    elif kind == "image" and vlm:
        from mmserve_client import Image

        content = [Image(data=_png(rng.randint(0, 3))), "What is this? " + text]
        await client.chat([{"role": "user", "content": content}], model=vlm, max_tokens=8)
    elif kind == "cancel":
        stream = client.generate_stream(text, model=CHAT, max_tokens=200, ignore_eos=True)
        async with stream:
            async for _ in stream:
                break  # leaving the stream cancels the call
    else:  # invalid: each must come back INVALID_ARGUMENT
        bad = rng.choice(["temperature", "model", "token", "schema"])
        if bad == "temperature":
            await client.generate(text, model=CHAT, temperature=-1.0, max_tokens=4)
        elif bad == "model":
            await client.generate(text, model="no-such-model", max_tokens=4)
        elif bad == "token":
            await client.generate([1, 10**9], model=CHAT, max_tokens=4)
        else:
            await client.generate(text, model=CHAT, json_schema='{"type": 5}', max_tokens=4)


def _pick(rng: random.Random, kinds: list[str]) -> str:
    roll = rng.random()
    if roll < 0.10:
        return "cancel"
    if roll < 0.15:
        return "invalid"
    return rng.choice(kinds)


def _kinds(registry: Any, vlm: str | None) -> list[str]:
    """The calls the served models can answer (a random-weight embedder may not rerank)."""
    embed_tasks = registry.get(EMBED).frontend.tasks
    kinds = ["generate", "generate", "embed", "structured"]
    return kinds + ["rerank"] * ("rerank" in embed_tasks) + ["image"] * (vlm is not None)


async def _traffic(
    target: str, seconds: float, concurrency: int, vlm: str | None, kinds: list[str]
) -> dict[str, int]:
    from mmserve_client import AsyncClient, MMServeError

    counts: Counter[str] = Counter()
    deadline = time.monotonic() + seconds

    async def caller(seed: int) -> None:
        rng = random.Random(seed)
        while time.monotonic() < deadline:
            kind = _pick(rng, kinds)
            try:
                await _call(client, kind, rng, vlm)
                outcome = "OK" if kind != "invalid" else "invalid-but-OK"
            except MMServeError as e:
                outcome = e.code.name if kind != "invalid" or e.code.name != "INVALID_ARGUMENT" else "OK"
            counts[f"{kind}:{outcome}"] += 1

    async with AsyncClient(target, timeout=120) as client:
        await asyncio.gather(*(caller(i) for i in range(concurrency)))
    return dict(counts)


def traffic(
    target: str, seconds: float, concurrency: int, vlm: str | None, kinds: list[str]
) -> dict[str, int]:
    return asyncio.run(_traffic(target, seconds, concurrency, vlm, kinds))


# -- the server side (this process) ---------------------------------------------------------


async def _canary(target: str) -> tuple[list[int], list[list[float]]]:
    from mmserve_client import AsyncClient

    async with AsyncClient(target, timeout=120) as client:
        out = await client.generate(CANARY_PROMPT, model=CHAT, max_tokens=12, temperature=0)
        vectors = await client.embed(CANARY_TEXTS, model=EMBED)
    return list(out.token_ids), [list(map(float, v)) for v in vectors]


def _blocks_in_use(registry: Any) -> dict[str, int | str]:
    """KV blocks held by requests per model (asked on each engine's own thread); "dead" for
    an engine that is down."""
    from mmserve.errors import EngineDead

    used: dict[str, int | str] = {}
    for handle in registry:
        try:
            total, free = handle.engine.kv_blocks()
        except EngineDead:
            used[handle.name] = "dead"
            continue
        used[handle.name] = total - free
    return used


def _engine_rss(registry: Any) -> float:
    pids = [getattr(h.frontend.client, "pid", None) for h in registry]
    return sum(rss_mb(pid) for pid in pids if pid)


@contextlib.contextmanager
def _server(args: argparse.Namespace) -> Iterator[tuple[str, Any, str | None]]:
    """(target, registry, name of a model that reads images or None)."""
    from mmserve.bench.engine_flags import engine_config
    from mmserve.bench.models import make_model_folder
    from mmserve.server.config import (
        ModelSpec,
        ServerConfig,
        embedded_default,
        embedded_embedder,
    )
    from mmserve.server.grpc_server import MMServer
    from mmserve.server.models import ModelRegistry, load_model

    paths = {
        CHAT: args.chat_model or embedded_default().path,
        EMBED: args.embed_model or embedded_embedder().path,
    }
    if args.model:
        paths["extra"] = args.model
    config = ServerConfig(host="127.0.0.1", port=0, max_pending=4 * args.soak_concurrency)
    handles = []
    for name, path in paths.items():
        folder, dummy = path, args.load_format == "dummy"
        if path.startswith("shape:"):  # random weights of a known shape
            folder, dummy = str(make_model_folder(path[6:], Path(tempfile.mkdtemp()) / name)), True
        template = engine_config(args, "", dummy, bool(getattr(args, "engine_process", False)))
        handles.append(load_model(ModelSpec(name, folder), template, config.max_pending))
    registry = ModelRegistry(handles)
    vlm = next((h.name for h in registry if h.facts.supports_images and "generate" in h.frontend.tasks), None)
    server = MMServer(registry, config)
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True, name="soak-server")
    thread.start()
    try:
        port = asyncio.run_coroutine_threadsafe(server.start(), loop).result(120)
        yield f"127.0.0.1:{port}", registry, vlm
    finally:
        asyncio.run_coroutine_threadsafe(server.drain(grace=5.0), loop).result(120)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)


def run(args: argparse.Namespace) -> None:
    if args.duration_s <= 0 or args.report_every_s <= 0 or args.soak_concurrency < 1:
        raise ValueError("soak: --duration-s, --report-every-s and --soak-concurrency must be > 0")
    spawn = multiprocessing.get_context("spawn")
    with _server(args) as (target, registry, vlm), ProcessPoolExecutor(1, mp_context=spawn) as pool:
        first, kinds = asyncio.run(_canary(target)), _kinds(registry, vlm)
        totals: Counter[str] = Counter()
        reports: list[dict[str, Any]] = []
        start = time.monotonic()
        while (left := args.duration_s - (time.monotonic() - start)) > 0:
            window = min(args.report_every_s, left)
            counts = pool.submit(traffic, target, window, args.soak_concurrency, vlm, kinds).result()
            totals.update(counts)
            canary = asyncio.run(_canary(target))
            exact = canary[0] == first[0] and _close(canary[1], first[1])
            report = {
                "bench": "soak", "elapsed_s": round(time.monotonic() - start, 1),
                "rss_mb": round(rss_mb(), 1), "engine_rss_mb": round(_engine_rss(registry), 1),
                "calls": dict(sorted(counts.items())), "canary_exact": exact,
            }  # fmt: skip
            reports.append(report)
            print(json.dumps(report), flush=True)
        time.sleep(1.0)  # the last aborts reach the engine threads
        print(json.dumps(_summary(reports, totals, _blocks_in_use(registry))), flush=True)


def _close(a: list[list[float]], b: list[list[float]]) -> bool:
    return all(abs(x - y) <= 1e-6 for u, v in zip(a, b, strict=True) for x, y in zip(u, v, strict=True))


def _summary(
    reports: list[dict[str, Any]], totals: Counter[str], blocks: dict[str, int | str]
) -> dict[str, Any]:
    """Growth after warm-up: the last report's RSS against the first's."""
    warm, last = reports[0], reports[-1]
    by_code: Counter[str] = Counter()
    for key, count in totals.items():
        by_code[key.split(":", 1)[1]] += count
    return {
        "bench": "soak-summary",
        "duration_s": last["elapsed_s"],
        "rss_after_warmup_mb": warm["rss_mb"],
        "rss_last_mb": last["rss_mb"],
        "rss_growth_mb": round(last["rss_mb"] - warm["rss_mb"], 1),
        "rss_growth_pct": round(100 * (last["rss_mb"] - warm["rss_mb"]) / max(warm["rss_mb"], 1), 2),
        "kv_blocks_in_use_idle": blocks,
        "calls_by_outcome": dict(sorted(by_code.items())),
        "calls_by_kind": dict(sorted(totals.items())),
        "canaries_exact": all(r["canary_exact"] for r in reports),
        "pid": os.getpid(),
    }
