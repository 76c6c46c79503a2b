"""`mmserve bench prefix`: time to first token on a prefix-cache miss and on a hit (issue 23).

An agent or chat backend sends the same long system prompt with every turn. Each of
--num-rounds rounds takes a new random system prompt of --system-len tokens (no earlier prompt
shares it) and asks two turns of --turn-len random tokens, one request at a time on an
otherwise idle engine, max_tokens 1:

- miss: the system prompt and the first turn: the whole prompt is prefilled.
- hit: the same system prompt and another turn: the prefix cache serves the system prompt's
  full blocks, and the step computes the turn (and the system prompt's last partial block).

One JSON line per phase (median and p90 over rounds, each request's num_cached_tokens), and
one with the hit's speedup (the miss's median TTFT over the hit's). One unrecorded round
first (kernel compilation, allocator growth).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import torch

from mmserve.bench.structured import percentile
from mmserve.frontend.frontend import FrontEnd
from mmserve.params import SamplingParams

FIRST_TOKEN = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
PHASES = ("miss", "hit")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options only `bench prefix` reads (--model and the engine flags are shared)."""
    p.add_argument("--system-len", type=int, default=4096, help="prefix: tokens of the shared system prompt")
    p.add_argument("--turn-len", type=int, default=64, help="prefix: tokens of each user turn")
    p.add_argument("--num-rounds", type=int, default=8, help="prefix: system prompts, each asked twice")


def first_token(engine: FrontEnd, request_id: str, ids: list[int], **extra: Any) -> tuple[float, int]:
    """Adds a request of max_tokens 1 to the idle engine and steps it to its first token:
    (perf_counter then, the prompt tokens the prefix cache served)."""
    engine.add_request(request_id, ids, FIRST_TOKEN, **extra)
    first, cached = 0.0, 0
    while engine.has_unfinished:
        for delta in engine.step_deltas():  # returns once the step's tokens are on the CPU
            if delta.error:
                raise RuntimeError(f"request {request_id} failed: {delta.error}")
            if delta.token_ids and not first:
                first, cached = time.perf_counter(), delta.num_cached_tokens
    return first, cached


def _tokens(gen: torch.Generator, n: int, vocab_size: int) -> list[int]:
    return torch.randint(1, vocab_size, (n,), generator=gen).tolist()


def run_rounds(
    engine: FrontEnd, rounds: int, system_len: int, turn_len: int, vocab_size: int
) -> list[dict[str, Any]]:
    """[{phase, ttft_ms, num_cached_tokens}] for each round's miss and hit, after round -1."""
    gen = torch.Generator().manual_seed(0)
    samples = []
    for i in range(-1, rounds):
        system = _tokens(gen, system_len, vocab_size)
        for phase in PHASES:
            ids = system + _tokens(gen, turn_len, vocab_size)
            start = time.perf_counter()
            first, cached = first_token(engine, f"{phase}-{i}", ids)
            if i >= 0:
                samples.append({"phase": phase, "ttft_ms": 1e3 * (first - start), "num_cached_tokens": cached})
    return samples


def run(args: argparse.Namespace) -> None:
    from mmserve.bench.engine_flags import engine_config
    from mmserve.bench.models import model_folder

    if args.num_rounds < 1 or args.system_len < 1 or args.turn_len < 1:
        raise ValueError("--num-rounds, --system-len and --turn-len must be >= 1")
    model = args.model or "shape:llama3-8b"
    folder, dummy = model_folder(model, args.load_format)
    # the context must hold the system prompt, the turn and the one token generated (the
    # bench's 4,096-token default of max_model_len does not: raise it, never lower it)
    args.max_model_len = max(args.max_model_len or 0, args.system_len + args.turn_len + 1)
    engine = FrontEnd.start(engine_config(args, str(folder), dummy))
    vocab_size = engine.info.vocab_size
    samples = run_rounds(engine, args.num_rounds, args.system_len, args.turn_len, vocab_size)
    common = {"model": model, "system_len": args.system_len, "turn_len": args.turn_len,
              "rounds": args.num_rounds, "block_size": engine.core.kv.block_size}  # fmt: skip
    medians = {}
    for phase in PHASES:
        ttft = [s["ttft_ms"] for s in samples if s["phase"] == phase]
        medians[phase] = statistics.median(ttft)
        _emit(bench="prefix-ttft", phase=phase, **common, ttft_ms_median=medians[phase],
              ttft_ms_p90=percentile(ttft, 0.9),
              num_cached_tokens=[s["num_cached_tokens"] for s in samples if s["phase"] == phase])  # fmt: skip
    _emit(bench="prefix", **common, miss_ms=medians["miss"], hit_ms=medians["hit"],
          hit_speedup=medians["miss"] / medians["hit"])  # fmt: skip


def _emit(**fields: Any) -> None:
    print(json.dumps(fields), flush=True)
