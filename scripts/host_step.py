"""The host's work per decode step, the model's compute stubbed out (CPU; issue 23). ROWS
requests of 512 prompt tokens decode OUT tokens each in one in-process engine (the Llama-3
tiny shape, its tokenizer), with the forward pass, the LM head and sampling replaced by
constants and random tokens, so what is timed is the scheduler, the KV-cache manager, the batch
building, the output handling and detokenising, and Python's garbage collector (its passes
counted and timed by generation). --structured constrains every request by `bench
structured`'s endless JSON grammar (xgrammar): the logits are then the vocabulary's width and the
stub draws a token the grammar allows, so the matchers' accepts and bitmask fills, and the mask's
application, are timed too (issue 23, target 6; the stubs' own time is measured and left out). Extra arguments go to the engine's bench flags
(e.g. --no-enable-prefix-caching); MMSERVE_GC_FREEZE=0 keeps the start-up heap in the collector.

    python scripts/host_step.py 256 128 [--profile] [--structured] [bench flags]
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import json
import pstats
import random
import sys
import time
from typing import Any

import torch

from mmserve.bench import cli
from mmserve.bench.checkpoints import model_path
from mmserve.bench.engine_flags import engine_config
from mmserve.bench.structured import ENDLESS_GRAMMAR
from mmserve.frontend.frontend import FrontEnd
from mmserve.params import SamplingParams
from mmserve.runner import model_runner
from mmserve.structured_output.params import StructuredOutputParams

PROMPT_LEN = 512


def main() -> None:
    rows, out_len, flags = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3:]
    profile, structured = "--profile" in flags, "--structured" in flags
    flags = [f for f in flags if f not in ("--profile", "--structured")]
    parser = argparse.ArgumentParser(prog="mmserve")
    cli.add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(
        ["bench", "throughput", "--model", "shape:llama3-tiny", "--device", "cpu",
         "--dtype", "float32", "--max-num-seqs", str(rows), "--max-num-batched-tokens", "16384",
         "--max-model-len", "1024", *flags]
    )  # fmt: skip
    path, dummy = model_path(args.model, args.load_format, args.checkpoint_format)
    engine = FrontEnd.start(engine_config(args, str(path), dummy))
    runner = engine.core.runner
    hidden = torch.zeros(16384, 256)
    runner._forward = lambda batch: hidden[: batch.input_ids.shape[0]]  # type: ignore[method-assign]
    width = runner.model.vocab_size if structured else 8
    stub_s = [0.0]  # the stubs' own time (vocabulary-wide logits are not free), taken off below

    def logits_stub(h: torch.Tensor) -> torch.Tensor:
        start = time.perf_counter()
        out = torch.zeros(h.shape[0], width)
        stub_s[0] += time.perf_counter() - start
        return out

    def sample(logits: torch.Tensor, sampling: list[Any], generator: Any = None) -> Any:
        if not structured:
            return torch.randint(1000, 30000, (logits.shape[0],)), [None] * len(sampling)
        # an allowed token (the mask left 0, not -inf): the first allowed of 256 random ids,
        # else the row's first allowed one
        start = time.perf_counter()
        picks = torch.randint(0, width, (logits.shape[0], 256))
        allowed = logits.gather(1, picks) == 0
        tokens = picks.gather(1, allowed.to(torch.int8).argmax(1, keepdim=True)).squeeze(1)
        none = ~allowed.any(1)
        if bool(none.any()):
            tokens[none] = logits[none].argmax(-1)
        stub_s[0] += time.perf_counter() - start
        return tokens, [None] * len(sampling)

    runner.model.compute_logits = logits_stub  # type: ignore[method-assign]

    model_runner.sample_on_device = sample  # type: ignore[assignment]
    rng = random.Random(0)
    constraint = StructuredOutputParams("grammar", ENDLESS_GRAMMAR) if structured else None
    params = SamplingParams(
        max_tokens=out_len, min_tokens=out_len, temperature=0.0, ignore_eos=True, structured=constraint
    )
    for i in range(rows):
        engine.add_request(f"r{i}", [rng.randrange(1000, 30000) for _ in range(PROMPT_LEN)], params)
    scheduler = engine.core.scheduler
    while len(scheduler.running) < rows or any(
        r.num_computed_tokens < PROMPT_LEN for r in scheduler.running
    ):
        engine.step()  # the prompts
    for _ in range(3):
        engine.step()
    passes = {"n": [0, 0, 0], "s": [0.0, 0.0, 0.0]}
    began = [0.0]

    def on_gc(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            began[0] = time.perf_counter()
        else:
            passes["n"][info["generation"]] += 1
            passes["s"][info["generation"]] += time.perf_counter() - began[0]

    gc.callbacks.append(on_gc)
    profiler = cProfile.Profile() if profile else None
    steps, start = 0, time.perf_counter()
    stub_s[0] = 0.0
    if profiler is not None:
        profiler.enable()
    while engine.has_unfinished:
        engine.step()
        steps += 1
    if profiler is not None:
        profiler.disable()
    seconds = time.perf_counter() - start
    gc.callbacks.remove(on_gc)
    print(json.dumps({
        "rows": rows, "steps": steps, "flags": flags, "structured": structured,
        "host_ms_per_step": round(1e3 * (seconds - stub_s[0]) / steps, 3),
        "stub_ms_per_step": round(1e3 * stub_s[0] / steps, 3),
        "us_per_row": round(1e6 * (seconds - stub_s[0]) / steps / rows, 2), "gc_passes": passes["n"],
        "gc_seconds": [round(v, 4) for v in passes["s"]], "frozen_objects": gc.get_freeze_count(),
    }))  # fmt: skip
    if profiler is not None:
        pstats.Stats(profiler).sort_stats("tottime").print_stats(30)
    engine.shutdown()


if __name__ == "__main__":
    main()
