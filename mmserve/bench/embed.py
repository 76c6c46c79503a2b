"""`mmserve bench embed`: batched Embed throughput offline (the engine's pooling API on its
AsyncFrontEnd) and over gRPC (a server on a free port, called through the SDK from a client
process of its own), against sentence-transformers on the same model, the same weights and the
same texts, in the same run. One JSON line per side.

The gRPC side is deployed as `mmserve serve` deploys it: the server's engine core runs in a
process of its own, a second copy of the model beside the offline side's (with
--no-engine-process the server shares the offline side's engine). The client process
times each call itself, as a user's program would (in the server's process it would contend
for the GIL with the front end and the engine thread, as `bench serve` notes).

The three sides take turns round by round (a round: 4 calls of each concurrent client), so a
machine whose load drifts (shared CI hosts) slows them alike; each side's calls run on a
worker thread (our engine steps on one), as oversubscribed OpenMP teams on the main thread can
be several times slower.

With --model shape:NAME the weights are random: they are drawn once (fixed seed), saved as
safetensors with sentence-transformers files (mean pooling, normalise), and both sides load
that folder, so both compute the same function."""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import random
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import torch

from mmserve.bench.embed_client import SERVED_NAME, client_embed, client_start
from mmserve.bench.models import SHAPES, make_model_folder
from mmserve.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from mmserve.frontend import pooling as pooling_api
from mmserve.frontend.frontend import FrontEnd

CALLS_PER_CLIENT = 4  # calls of each concurrent client in one timed round
T = TypeVar("T")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options only `bench embed` reads (--model, --device, --dtype, --batch-size and
    --max-num-batched-tokens are shared with the other kinds)."""
    p.add_argument("--seq-len", type=int, default=128, help="embed: tokens per text (about)")
    p.add_argument(
        "--seq-len-spread",
        type=float,
        default=0.0,
        help="embed: text lengths vary uniformly by this fraction of --seq-len (default 0)",
    )
    p.add_argument(
        "--num-batches",
        type=int,
        default=10,
        help=f"embed: timed rounds per side, each of {CALLS_PER_CLIENT} x --concurrency calls",
    )
    p.add_argument(
        "--concurrency",
        type=int,
        default=1,
        help="embed: Embed calls in flight at once on the offline and gRPC sides (each of "
        "--batch-size texts), as that many clients each sending its next call when the last "
        "returns; sentence-transformers encodes the calls one after another",
    )
    p.add_argument("--skip-grpc", action="store_true", help="embed: offline and baseline only")
    p.add_argument("--threads", type=int, default=None, help="embed: torch CPU threads")


def model_folder(model: str) -> Path:
    """A model path as is; shape:NAME -> a folder with random weights saved as safetensors."""
    if not model.startswith("shape:"):
        return Path(model)
    shape = model.split(":", 1)[1]
    if shape in SHAPES and SHAPES[shape]["model_type"] != "bert":
        raise ValueError(f"bench embed needs an encoder shape; {shape!r} is not one")
    folder = make_model_folder(shape, Path(tempfile.mkdtemp()) / "model")
    save_random_bert(folder)
    return folder


def save_random_bert(folder: Path, seed: int = 0) -> None:
    """transformers' own random init (fixed seed) of the folder's config, as safetensors,
    plus the sentence-transformers files of a mean-pooled, normalised embedder."""
    from transformers import AutoConfig, BertModel

    torch.manual_seed(seed)
    config = AutoConfig.from_pretrained(str(folder))
    BertModel(config).save_pretrained(str(folder))
    modules = [("Transformer", ""), ("Pooling", "1_Pooling"), ("Normalize", "2_Normalize")]
    (folder / "modules.json").write_text(
        json.dumps(
            [
                {
                    "idx": i,
                    "name": str(i),
                    "path": path,
                    "type": f"sentence_transformers.models.{kind}",
                }
                for i, (kind, path) in enumerate(modules)
            ]
        )
    )
    (folder / "1_Pooling").mkdir(exist_ok=True)
    (folder / "2_Normalize").mkdir(exist_ok=True)
    pooling = {"word_embedding_dimension": config.hidden_size, "pooling_mode_mean_tokens": True}
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    max_len = config.max_position_embeddings
    (folder / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": max_len}))


def make_texts(
    tokenizer: Any, count: int, seq_len: int, spread: float = 0.0, seed: int = 0
) -> list[str]:
    """`count` different texts of random whole-word vocabulary entries, each tokenising to
    about seq_len tokens (special tokens included), or to a length drawn uniformly from
    seq_len * [1 - spread, 1 + spread]."""
    rng = random.Random(seed)
    words = sorted(w for w in tokenizer.get_vocab() if w.isalpha() and w.isascii() and len(w) > 2)
    texts = []
    for _ in range(count):
        length = round(seq_len * rng.uniform(1 - spread, 1 + spread)) if spread else seq_len
        ids = tokenizer(" ".join(rng.choices(words, k=length)), add_special_tokens=False)
        texts.append(tokenizer.decode(ids["input_ids"][: max(1, length - 2)]))
    return texts


class Sides:
    """The engine behind a server, sentence-transformers on a worker thread: one callable per
    side, each embedding one batch and returning its float32 vectors and the seconds the call
    took."""

    def __init__(
        self,
        engine: FrontEnd,
        folder: Path,
        device: torch.device,
        dtype: torch.dtype,
        server_engine: FrontEnd | None = None,
        concurrency: int = 1,
    ):
        """server_engine: the gRPC side's engine (default: the offline side's); concurrency:
        Embed calls in flight at once."""
        from sentence_transformers import SentenceTransformer

        from mmserve.server.config import ModelSpec, ServerConfig
        from mmserve.server.grpc_server import MMServer
        from mmserve.server.models import ModelRegistry, handle_for

        spec = ModelSpec(SERVED_NAME, str(folder))
        self.concurrency = concurrency
        pending = max(4, concurrency)
        offline = handle_for(spec, engine, max_pending=pending)
        self.async_engine = offline.engine
        handle = offline if server_engine is None else handle_for(spec, server_engine, pending)
        self._own_offline = handle is not offline  # the server shuts down only its own
        self.server = MMServer(ModelRegistry([handle]), ServerConfig(port=0))
        self.loop = asyncio.new_event_loop()
        self._loop_thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._loop_thread.start()
        port = self._on_loop(self.server.start())
        spawn = multiprocessing.get_context("spawn")
        self.client = ProcessPoolExecutor(
            1,
            mp_context=spawn,
            initializer=client_start,
            initargs=(f"127.0.0.1:{port}", concurrency),
        )
        self.st_thread = ThreadPoolExecutor(1, thread_name_prefix="sentence-transformers")
        self.st = self.st_thread.submit(
            lambda: SentenceTransformer(
                str(folder), device=str(device), model_kwargs={"dtype": dtype}
            )
        ).result()

    def _on_loop(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(600)

    def offline(self, calls: list[list[str]]) -> tuple[np.ndarray, float]:
        start = time.perf_counter()
        embed = partial(pooling_api.embed, self.async_engine, truncate="right")
        results = self._on_loop(_closed_loop(embed, calls, self.concurrency))
        return np.asarray(results[0].embeddings.numpy()), time.perf_counter() - start

    def grpc(self, calls: list[list[str]]) -> tuple[np.ndarray, float]:
        return self.client.submit(client_embed, calls).result()

    def sentence_transformers(self, calls: list[list[str]]) -> tuple[np.ndarray, float]:
        def timed() -> tuple[np.ndarray, float]:
            start = time.perf_counter()
            vectors = [self.st.encode(b, batch_size=len(b), convert_to_numpy=True) for b in calls]
            return np.asarray(vectors[0], dtype=np.float32), time.perf_counter() - start

        return self.st_thread.submit(timed).result()

    def close(self) -> None:
        self.client.shutdown()
        self._on_loop(self.server.drain(grace=5))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._loop_thread.join(10)
        self.st_thread.shutdown()
        if self._own_offline:
            self.async_engine.shutdown()


async def _closed_loop(
    call: Callable[[list[str]], Awaitable[T]], batches: list[list[str]], clients: int
) -> list[T]:
    """call(batch) for every batch, from `clients` loops that each start the next batch as
    soon as their last call returns (as the SDK client's threads do); results in order."""
    results: list[T | None] = [None] * len(batches)
    pending = iter(enumerate(batches))

    async def client() -> None:
        for i, batch in pending:  # shared: each loop takes the next batch not yet taken
            results[i] = await call(batch)

    await asyncio.gather(*(client() for _ in range(min(clients, len(batches)))))
    return results  # type: ignore[return-value]  # every slot is filled


Side = Callable[[list[list[str]]], tuple[np.ndarray, float]]  # calls -> (vectors, seconds)


def measure(
    sides: dict[str, Side], rounds: Sequence[list[list[str]]]
) -> tuple[dict[str, float], dict[str, np.ndarray]]:
    """Seconds per side over rounds[1:] (as each side timed them), taking turns round by
    round (rounds[0] warms each side up), and each side's vectors of rounds[0][0]."""
    first = {name: side(rounds[0])[0] for name, side in sides.items()}
    seconds = dict.fromkeys(sides, 0.0)
    for calls in rounds[1:]:
        for name, side in sides.items():
            seconds[name] += side(calls)[1]
    return seconds, first


def run(args: argparse.Namespace) -> None:
    from mmserve.models.loader import resolve_device, resolve_dtype

    if args.threads:
        torch.set_num_threads(args.threads)
    model = args.model or "shape:bert-base"
    folder = model_folder(model)
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    engine_process = args.engine_process is not False and not args.skip_grpc
    config, server_config = engine_configs(args, folder, engine_process)
    engine = FrontEnd.start(config)
    server_engine = None
    if server_config is not None:  # as `mmserve serve` runs: the core in its own process
        server_engine = FrontEnd.start(server_config)
    if args.concurrency < 1:
        raise ValueError("--concurrency must be >= 1")
    per_round = args.batch_size * args.concurrency * CALLS_PER_CLIENT
    count = per_round * (args.num_batches + 1)
    texts = make_texts(engine.tokenizer, count, args.seq_len, args.seq_len_spread)
    batches = [texts[i : i + args.batch_size] for i in range(0, len(texts), args.batch_size)]
    calls = args.concurrency * CALLS_PER_CLIENT
    rounds = [batches[i : i + calls] for i in range(0, len(batches), calls)]
    timed = [b for calls in rounds[1:] for b in calls]
    tokens = sum(
        len(e.token_ids) for b in timed for e in engine.input_encoder.encode(b, "right", "inputs")
    )
    sides = Sides(engine, folder, device, dtype, server_engine, args.concurrency)
    try:
        chosen: dict[str, Side] = {
            "offline": sides.offline,
            "sentence-transformers": sides.sentence_transformers,
        }
        if not args.skip_grpc:
            chosen["grpc"] = sides.grpc
        seconds, first = measure(chosen, rounds)
    finally:
        sides.close()
    texts_timed = count - per_round
    common = {
        "model": model,
        "device": str(device),
        "dtype": str(dtype).removeprefix("torch."),
        "batch_size": args.batch_size,
        "seq_len": args.seq_len,
        "seq_len_spread": args.seq_len_spread,
        "tokens_per_text": tokens / texts_timed,
        "num_batches": args.num_batches,
        "concurrency": args.concurrency,
        "threads": torch.get_num_threads(),
        "grpc_engine_process": engine_process,
    }
    base = seconds["sentence-transformers"]
    for name, secs in seconds.items():
        out: dict[str, Any] = {"bench": f"embed-{name}", **common}
        out.update(texts_per_s=texts_timed / secs, tokens_per_s=tokens / secs)
        if name != "sentence-transformers":
            out["ratio_to_sentence_transformers"] = base / secs
            out["min_cosine_to_sentence_transformers"] = _min_cosine(
                first[name], first["sentence-transformers"]
            )
        print(json.dumps(out), flush=True)


def engine_configs(
    args: argparse.Namespace, folder: Path, engine_process: bool
) -> tuple[EngineConfig, EngineConfig | None]:
    """The offline side's engine config, and the gRPC side's when it gets an engine process
    of its own. Two engines on one GPU split --gpu-memory-utilization: each sizes its KV cache
    from the share of the whole card it may use, counting what is in use already, so the
    first takes half and the second the rest (encoders keep no KV cache either way)."""
    share = args.gpu_memory_utilization
    config = EngineConfig(
        model=ModelConfig(model=str(folder), device=args.device, dtype=args.dtype),
        cache=CacheConfig(gpu_memory_utilization=share / 2 if engine_process else share),
        scheduler=SchedulerConfig(
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_num_seqs=max(args.batch_size, 1),
        ),
    )
    if not engine_process:
        return config, None
    server = replace(config, cache=CacheConfig(gpu_memory_utilization=share), multiprocess=True)
    return config, server


def _min_cosine(a: np.ndarray, b: np.ndarray) -> float:
    norms = np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1)
    return float(((a * b).sum(-1) / norms).min())
