"""Start-up warm-up: a few dummy requests through the model runner before the first real one.

Triton compiles a kernel the first time it runs with a new set of compile-time constants:
tile sizes chosen from the shapes (attention's query tiles by the longest query of a step,
the products' tiles by their rows) and integer arguments that are 1 or divisible by 16. CUDA
graph capture compiles what decode steps use; the first prefills of a fresh server compiled
the rest while clients waited (TTFT p99 500 ms in the first minute on the H200, issue 23).

warm_up() runs prompts of lengths that reach each of those cases:
- one token; 3, 7, 16 and 31 tokens, which span the attention tiles of a group of up to 8 query
  heads; 100 and 512;
- 1041, an eager step past the largest default prefill graph (1024, FP8/INT8) whose row count
  is no multiple of 16 (INT8's large-tile product compiled that variant 18 s into serving);
- one longer than the token budget, which prefills in two chunks.
They run first each alone (a prefill, then decodes at batch 1), then 2, 3 and 4 prompts of
ROWS_PROMPT_LEN at once (an eager prefill that samples that many rows: few-row kernels, GGUF's
and w4a16's int8-activation products among them, compile a variant per row count; a GGUF
file's LM head compiled its two-row variant 2.7 s into a batch-2 benchmark), then all at once
(mixed steps of prefill chunks and decodes at several batch sizes), greedy and sampled (top-k,
top-p, a seed of its own). It uses a scheduler and KV
bookkeeping of its own, without prefix caching: the engine's own scheduler, counters and
prefix cache are untouched, and the KV blocks the dummies wrote are free again (a block is
always written before it is read). Images and speculative guesses are not warmed. Of the
grammars, the kernel that applies their masks to the logits is (warm_grammar_masks): its
launches differ by row count only, which Triton specialises as one row, a multiple of 16, or
any other (on the H100 its three variants compiled 9-12 s into a constrained benchmark, each
while a step waited).
"""

from __future__ import annotations

import logging
import time

import torch

from mmserve.config import EngineConfig
from mmserve.engine.kv_cache_manager import KVCacheManager
from mmserve.engine.sched_output import RunnerOutput
from mmserve.engine.scheduler import Scheduler
from mmserve.params import SamplingParams
from mmserve.request import Request
from mmserve.runner.model_runner import ModelRunner
from mmserve.structured_output.backend import allocate_bitmask, apply_bitmask

logger = logging.getLogger(__name__)
PROMPT_LENS = (1, 3, 7, 16, 31, 100, 512, 1041)  # and one past the token budget
OUTPUT_TOKENS = 4
MAX_STEPS = 2000  # a guard: the dummies never take this many
# prompts of this length (past every default prefill graph together, no multiple of 16) come
# ROWS_WAVES at a time
ROWS_PROMPT_LEN = 517
ROWS_WAVES = (2, 3, 4)


def warm_up(
    runner: ModelRunner, config: EngineConfig, num_blocks: int, max_model_len: int, vocab_size: int
) -> int:
    """Runs the dummy requests (module docstring); returns how many steps they took."""
    block_size = config.cache.block_size
    budget = config.scheduler.budget
    # each prompt and its output fits the context, and half of the KV cache (so that a wave of
    # several always makes progress, by preempting if it must)
    half = num_blocks * block_size // 2
    room = min(max_model_len, half) - OUTPUT_TOKENS
    lens = [n for n in (*PROMPT_LENS, budget + 17) if n <= room]
    rows_waves = [
        [ROWS_PROMPT_LEN] * k for k in ROWS_WAVES
        if ROWS_PROMPT_LEN <= room and k * (ROWS_PROMPT_LEN + OUTPUT_TOKENS) <= half
    ]  # fmt: skip
    greedy = SamplingParams(max_tokens=OUTPUT_TOKENS, temperature=0.0, ignore_eos=True)
    sampled = SamplingParams(
        max_tokens=OUTPUT_TOKENS, temperature=0.8, top_k=50, top_p=0.9, seed=0, ignore_eos=True
    )
    scheduler = Scheduler(config.scheduler, KVCacheManager(num_blocks, block_size, False), max_model_len)
    steps = 0
    for wave, prompt_lens in enumerate([*([n] for n in lens), *rows_waves, lens]):
        for i, n in enumerate(prompt_lens):
            prompt = [(7 * j + 1) % vocab_size for j in range(n)]
            params = sampled if i % 2 else greedy
            scheduler.add_request(Request(f"warmup-{wave}-{i}", prompt, params, frozenset(), OUTPUT_TOKENS))
        while scheduler.has_unfinished:
            steps += 1
            if steps > MAX_STEPS:
                raise RuntimeError(f"the start-up warm-up did not finish in {MAX_STEPS} steps")
            plan = scheduler.schedule()
            step = runner.launch(plan)
            if step is None:
                scheduler.update(plan, RunnerOutput())
                continue
            runner.sample(step, scheduler.requests)
            scheduler.update(plan, runner.resolve(step))
    runner.launch(scheduler.schedule())  # the runner forgets the last of them
    return steps


MASK_ROW_COUNTS = (1, 2, 16)  # how Triton specialises an integer: 1, a multiple of 16, other


def warm_grammar_masks(device: torch.device, vocab_size: int) -> None:
    """Applies all-allowing grammar masks (which change nothing) to float32 logits of the
    vocabulary, on MASK_ROW_COUNTS rows: every variant of the device's mask kernel the engine's
    steps launch (model_runner._mask)."""
    rows = max(MASK_ROW_COUNTS)
    logits = torch.zeros(rows, vocab_size, dtype=torch.float32, device=device)
    bitmask = allocate_bitmask(rows, vocab_size, device.type == "cuda")
    for n in MASK_ROW_COUNTS:
        apply_bitmask(logits, bitmask, list(range(n)))
    if device.type == "cuda":
        torch.cuda.synchronize(device)


LOGGED_COMPILES = 20  # late compiles logged one by one; the rest only counted


class LateCompiles:
    """Triton's post-compile hook once start-up is over: counts, and logs the first
    LOGGED_COMPILES of, the kernels compiled while serving. Each one is a variant (tile sizes,
    specialised integer arguments) that graph capture and the warm-up did not reach, compiled
    while a request waited: what the warm-up should cover next."""

    def __init__(self) -> None:
        self.count = 0
        self.start = time.monotonic()

    def __call__(self, *args: object, **hook: object) -> None:
        # (whatever a Triton version passes: a hook that raised would fail the kernel's launch)
        self.count += 1
        if self.count <= LOGGED_COMPILES:
            kernel = describe_compile(hook) or " ".join(str(hook.get("repr", "?")).split())[:2000]
            logger.warning(
                "a Triton kernel compiled while serving (%.1f s after start-up, %d so far): %s",
                time.monotonic() - self.start, self.count, kernel,
            )  # fmt: skip


def describe_compile(hook: dict[str, object]) -> str:
    """One line naming a compiled kernel and what it was specialised on: each argument's type,
    its specialisation attributes (pointer alignment, integer divisibility) and each constexpr's
    value, from the post-compile hook's `compile` data. ("" where that data is not as Triton
    3.x passes it. Triton's own `repr` is built from the cache key and, since the key became a
    string, names only the first argument.)"""
    try:
        compile_ = hook.get("compile")
        fn = hook.get("fn")
        if not isinstance(compile_, dict) or not isinstance(compile_.get("signature"), dict):
            return ""
        constants = compile_.get("constants") or {}
        configs = compile_.get("configs") or [{}]
        attrs = configs[0] if isinstance(configs, (list, tuple)) and configs else {}
        parts = []
        for i, (name, ty) in enumerate(compile_["signature"].items()):
            if ty == "constexpr":
                parts.append(f"{name}={constants.get((i,))!r}")
                continue
            special = ",".join(f"{a}={v}" for a, v in attrs.get((i,), ()))
            parts.append(f"{name}:{ty}" + (f"[{special}]" if special else ""))
        options = ", ".join(f"{k}={compile_.get(k)}" for k in ("num_warps", "num_stages"))
        return f"{getattr(fn, 'name', '?')}[{options}]({', '.join(parts)})"[:2000]
    except Exception:  # noqa: BLE001 - a hook that raised would fail the kernel's launch
        return ""


def watch_late_compiles() -> LateCompiles | None:
    """Installs a LateCompiles as Triton's post-compile hook (None: this Triton has no such
    knob, or another hook is installed, which is left alone)."""
    try:
        from triton import knobs
    except ImportError:
        return None
    runtime = getattr(knobs, "runtime", None)
    if runtime is None or not hasattr(runtime, "jit_post_compile_hook"):
        return None
    if runtime.jit_post_compile_hook is not None:
        return None
    watch = LateCompiles()
    runtime.jit_post_compile_hook = watch
    return watch


def timed_warm_up(runner: ModelRunner, config: EngineConfig, num_blocks: int, max_model_len: int,
                  vocab_size: int, grammars: bool = False) -> float:  # fmt: skip
    """warm_up(), and warm_grammar_masks() where the engine takes grammars, logged; the
    seconds they took."""
    start = time.perf_counter()
    steps = warm_up(runner, config, num_blocks, max_model_len, vocab_size)
    if grammars:
        warm_grammar_masks(runner.device, vocab_size)
    seconds = time.perf_counter() - start
    logger.info("warm-up: %d steps of dummy requests in %.1f s", steps, seconds)
    return seconds
