"""Offline benchmarks on the engine itself: batch-1 latency and batch throughput."""

from __future__ import annotations

import itertools
import random
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

from mmserve.bench.host_times import HostTimes, host_times
from mmserve.engine.sched_output import SchedulerOutput
from mmserve.frontend.frontend import FrontEnd
from mmserve.params import SamplingParams


@dataclass(frozen=True)
class LatencyResult:
    prefill_ms: float  # from adding the request to its first token on the host
    decode_ms_median: float  # one decode step at batch 1
    decode_ms_p99: float
    input_len: int
    output_len: int


@dataclass(frozen=True)
class ThroughputResult:
    num_requests: int
    input_tokens: int
    output_tokens: int
    seconds: float
    steps: int
    kv_cache_tokens: int = 0  # what the KV pool holds
    peak_running: int = 0  # the most requests decoding or prefilling in one step
    preemptions: int = 0  # requests put back to wait for KV blocks (their tokens computed again)
    # where the time went: {"decode": ..., "prefill": ...} (steps_breakdown's)
    breakdown: dict[str, dict[str, float]] = field(default_factory=dict)
    # the engine thread's ms a step by part (mmserve.bench.host_times; "wait": blocked on the
    # device's tokens, near zero when the host sets the pace), and the run's wall ms a step
    host_ms_per_step: dict[str, float] = field(default_factory=dict)
    host_wall_ms_per_step: float = 0.0

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds

    @property
    def total_tokens_per_s(self) -> float:
        return (self.input_tokens + self.output_tokens) / self.seconds


DEFAULT_BATCH_SIZES = "1,64"  # structured, spec, spec-cost


def parse_batch_sizes(text: str) -> list[int]:
    try:
        sizes = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        sizes = []
    if not sizes or any(s < 1 for s in sizes):
        raise ValueError(f"--batch-sizes: give positive integers, comma-separated, got {text!r}")
    return sizes


def random_prompt(rng: random.Random, length: int, vocab: int) -> list[int]:
    return [rng.randrange(100, vocab - 100) for _ in range(length)]


def _fixed_length(output_len: int) -> SamplingParams:
    return SamplingParams(max_tokens=output_len, min_tokens=output_len, temperature=0.0, ignore_eos=True)


def latency(engine: FrontEnd, input_len: int, output_len: int, repeats: int = 3) -> LatencyResult:
    """A lone request, timed by when its tokens reach the host: the first after the prefill,
    then one per decode step (with async scheduling a step() returns before its own tokens
    are ready, so step() calls are not timed)."""
    rng = random.Random(0)
    prefill, decode = [], []
    for r in range(repeats + 1):  # the first round warms up (allocations, autotuning)
        engine.core.kv.pool.reset_cache()
        start = time.perf_counter()
        engine.add_request(f"lat-{r}", random_prompt(rng, input_len, engine.vocab_size), _fixed_length(output_len))
        stamps = []
        while engine.has_unfinished:
            if any(d.token_ids for d in engine.step_deltas()):
                stamps.append(time.perf_counter())
        if r:
            prefill.append(stamps[0] - start)
            decode += [b - a for a, b in itertools.pairwise(stamps)]
    decode.sort()
    return LatencyResult(
        prefill_ms=1e3 * statistics.median(prefill),
        decode_ms_median=1e3 * statistics.median(decode),
        decode_ms_p99=1e3 * decode[int(0.99 * (len(decode) - 1))],
        input_len=input_len,
        output_len=output_len,
    )


def throughput(
    engine: FrontEnd, num_requests: int, input_len: int, output_len: int, random_ratio: float = 0.0
) -> ThroughputResult:
    """All requests queued at once; lengths vary by +-random_ratio when it is > 0."""
    rng = random.Random(0)

    def vary(n: int) -> int:
        return max(1, int(n * rng.uniform(1 - random_ratio, 1 + random_ratio))) if random_ratio else n

    requests = [(random_prompt(rng, vary(input_len), engine.vocab_size), vary(output_len)) for _ in range(num_requests)]
    engine.core.kv.pool.reset_cache()
    warm_prompt, _ = requests[0]
    engine.add_request("warmup", warm_prompt, _fixed_length(4))
    while engine.has_unfinished:
        engine.step()
    engine.core.kv.pool.reset_cache()
    start = time.perf_counter()
    for i, (prompt, out_len) in enumerate(requests):
        engine.add_request(f"tp-{i}", prompt, _fixed_length(out_len))
    steps = peak = 0
    landed: list[tuple[SchedulerOutput, float]] = []  # each plan as its tokens reach the host
    scheduler = engine.core.scheduler
    preempted = scheduler.num_preemptions
    host = HostTimes()
    with host_times(engine.core, host):
        update = scheduler.update  # (host_times' timed wrapper)

        def recorded(plan: SchedulerOutput, output: Any) -> Any:
            landed.append((plan, time.perf_counter()))
            return update(plan, output)

        scheduler.update = recorded  # type: ignore[method-assign,assignment]
        try:
            while engine.has_unfinished:
                engine.step()
                steps += 1
                peak = max(peak, len(scheduler.running))
        finally:
            scheduler.update = update  # type: ignore[method-assign]  # (host_times then removes it)
    seconds = time.perf_counter() - start
    return ThroughputResult(
        num_requests=num_requests,
        input_tokens=sum(len(p) for p, _ in requests),
        output_tokens=sum(n for _, n in requests),
        seconds=seconds,
        steps=steps,
        kv_cache_tokens=engine.core.kv.num_blocks * engine.core.kv.block_size,
        peak_running=peak,
        preemptions=scheduler.num_preemptions - preempted,
        breakdown=steps_breakdown(landed, start),
        host_ms_per_step=host.per_step_ms(),
        host_wall_ms_per_step=host.wall_ms_per_step(),
    )


def steps_breakdown(landed: list[tuple[SchedulerOutput, float]], start: float) -> dict[str, dict[str, float]]:
    """The run's time by kind of step: "decode" (every request past its prompt) and "prefill"
    (prompt tokens, with or without decodes beside them): steps, seconds, tokens, prompt
    tokens, decode rows. landed: each plan with the time its outputs reached the scheduler; a
    plan's time is from the landing before it (or start) to its own, which with a step in
    flight (async scheduling) is its device time, the host's work for the next overlapping."""
    out: dict[str, dict[str, float]] = {
        kind: {"steps": 0, "seconds": 0.0, "tokens": 0, "prompt_tokens": 0, "decode_rows": 0}
        for kind in ("decode", "prefill")
    }
    before = start
    for plan, at in landed:
        seconds, before = at - before, at
        if plan.is_empty:
            continue
        prompt = [len(s.token_ids) for s in plan.scheduled if s.start_pos < len(s.prompt_token_ids)]
        row = out["prefill" if prompt else "decode"]
        row["steps"] += 1
        row["seconds"] += seconds
        row["tokens"] += plan.num_tokens
        row["prompt_tokens"] += sum(prompt)
        row["decode_rows"] += len(plan.scheduled) - len(prompt)
    return out
