"""What the engine's metrics cost per step, for BENCHMARKS.md: EngineStats taken after a step
(Scheduler.stats) with a full batch and a long queue, and the bytes and time it adds to the
Outputs message the engine process sends anyway (msgpack encode + decode). CPU only; compare
with a step's time (BENCHMARKS.md "CPU step time": ~0.4 s at the CPU budget of 64 tokens; a
CUDA decode step of 64 sequences takes milliseconds). usage: python scripts/metrics_step_cost.py"""
import time

from mmserve.config import SchedulerConfig
from mmserve.engine import messages as m
from mmserve.engine.kv_cache_manager import KVCacheManager
from mmserve.engine.scheduler import Scheduler
from mmserve.params import SamplingParams
from mmserve.request import Request


def best_us(fn, reps=2000, rounds=5):
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(reps):
            fn()
        best = min(best, (time.perf_counter() - start) / reps)
    return best * 1e6


scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=64 * 512, max_num_seqs=64),
                      KVCacheManager(8192, 16), 4096)
for i in range(256):  # 64 run, 192 wait
    prompt = [(i * 31 + j) % 30000 for j in range(500)]
    scheduler.add_request(Request(f"r{i}", prompt, SamplingParams(max_tokens=64), frozenset(), 64))
scheduler.schedule()
stats = scheduler.stats()
assert (stats.num_running, stats.num_waiting) == (64, 192), stats
outputs = [m.EngineOutput(f"r{i}", [123], None, None, None, num_prompt_tokens=500,
                          num_output_tokens=10, first_scheduled_time=1.0) for i in range(64)]
bare, carried = m.Outputs(outputs), m.Outputs(outputs, stats)


def roundtrip(msg):
    return lambda: m.from_core_decoder.decode(m.encoder.encode(msg))


take = best_us(scheduler.stats)
plain, with_stats = best_us(roundtrip(bare)), best_us(roundtrip(carried))
extra = len(m.encoder.encode(carried)) - len(m.encoder.encode(bare))
print(f"Scheduler.stats() with 64 running + 192 waiting: {take:.1f} us")
print(f"Outputs of 64 sequences, encode+decode: {plain:.1f} us bare, {with_stats:.1f} us with "
      f"stats (+{with_stats - plain:.1f} us, +{extra} bytes)")
print(f"per step: {take + with_stats - plain:.1f} us = "
      f"{(take + with_stats - plain) / 4e5 * 100:.4f}% of a 0.4 s CPU step, "
      f"{(take + with_stats - plain) / 1e4 * 100:.2f}% of a 10 ms GPU step")
