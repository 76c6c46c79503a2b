"""Where one Embed call's time goes, offline (issue 23, target 4): calls of --batch-size texts
of --seq-len tokens through the pooling API, one at a time as one client makes them, and the
milliseconds per call spent tokenising, in the engine's step parts (mmserve.bench.host_times;
"wait" is the engine thread waiting for the device) and in all. The engine's thread and the
front end's workers run beside the caller, so the parts can overlap. --stub replaces the
model's forward pass by a constant hidden state, leaving the host's work alone (any machine).
encode_ms_alone is the same texts' tokenising with nothing beside it (what the host's cores
and the Rust tokenizer's threads can do), against encode_ms_per_call inside the calls.
--min-chunk sets pooling.IDLE_PIPELINE_MIN_CHUNK for the run (the default, 32, sends a 64-text
call in halves, the second tokenised while the model runs the first); 64 sends it whole, to
compare on the same machine.

Usage: python3 scripts/embed_host.py [--model shape:bert-base] [--device cuda] [--calls 40] [--stub]
                                     [--min-chunk N]"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time
from typing import Any

import torch

from mmserve.bench.embed import make_texts, model_folder
from mmserve.bench.host_times import HostTimes, host_times
from mmserve.config import EngineConfig, ModelConfig, SchedulerConfig
from mmserve.frontend import pooling as pooling_api
from mmserve.frontend.async_frontend import AsyncFrontEnd
from mmserve.frontend.frontend import FrontEnd


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="shape:bert-base")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--calls", type=int, default=40)
    p.add_argument("--stub", action="store_true", help="the forward pass a constant: the host alone")
    p.add_argument("--min-chunk", type=int, default=pooling_api.IDLE_PIPELINE_MIN_CHUNK,
                   help="inputs of a call sent to an idle engine at once, at least (pooling.py)")
    args = p.parse_args()
    pooling_api.IDLE_PIPELINE_MIN_CHUNK = args.min_chunk
    folder = model_folder(args.model)
    engine = FrontEnd.start(
        EngineConfig(
            model=ModelConfig(model=str(folder), device=args.device, dtype=args.dtype),
            scheduler=SchedulerConfig(max_num_batched_tokens=16384, max_num_seqs=args.batch_size),
        )
    )
    if args.stub:
        runner = engine.core.runner
        width = runner.model.hidden_size
        hidden = torch.ones(args.batch_size * args.seq_len * 2, width, dtype=next(runner.model.parameters()).dtype,
                            device=runner.device)  # fmt: skip
        runner._forward = lambda batch: hidden[: batch.input_ids.shape[0]]  # type: ignore[method-assign]
    texts = make_texts(engine.tokenizer, args.batch_size * (args.calls + 4), args.seq_len)
    batches = [texts[i : i + args.batch_size] for i in range(0, len(texts), args.batch_size)]
    encoder = engine.input_encoder
    alone = []
    for batch in batches[4:]:
        start = time.perf_counter()
        encoder.encode(batch, "right", "inputs")
        alone.append(time.perf_counter() - start)
    encode_s = [0.0]
    plain_encode = encoder.encode

    def timed_encode(*a: Any, **k: Any) -> Any:
        start = time.perf_counter()
        try:
            return plain_encode(*a, **k)
        finally:
            encode_s[0] += time.perf_counter() - start

    encoder.encode = timed_encode  # type: ignore[method-assign]
    aengine = AsyncFrontEnd(engine)

    async def calls(todo: list[list[str]]) -> list[float]:
        out = []
        for batch in todo:
            start = time.perf_counter()
            await pooling_api.embed(aengine, batch, truncate="right")
            out.append(time.perf_counter() - start)
        return out

    asyncio.run(calls(batches[:4]))  # warm-up
    encode_s[0] = 0.0
    parts = HostTimes()
    with host_times(engine.core, parts):
        seconds = asyncio.run(calls(batches[4:]))
    n = len(seconds)
    line = {
        "bench": "embed-host",
        "model": args.model,
        "stub": args.stub,
        "device": engine.info.device,
        "batch_size": args.batch_size,
        "seq_len": args.seq_len,
        "calls": n,
        "ms_per_call_median": round(1e3 * statistics.median(seconds), 3),
        "texts_per_s": round(args.batch_size * n / sum(seconds), 1),
        "encode_ms_per_call": round(1e3 * encode_s[0] / n, 3),
        "encode_ms_alone": round(1e3 * statistics.median(alone), 3),
        "min_chunk": args.min_chunk,
        "cpus": len(os.sched_getaffinity(0)),
        "tokenizers_parallelism": os.environ.get("TOKENIZERS_PARALLELISM", "(unset)"),
        "engine_steps_per_call": round(parts.steps / n, 2),
        "engine_ms_per_call": {k: round(1e3 * v / n, 3) for k, v in parts.seconds.items()},
    }
    print(json.dumps(line), flush=True)
    aengine.shutdown()


if __name__ == "__main__":
    main()
