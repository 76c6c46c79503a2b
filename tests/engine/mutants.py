"""Named mutants of the scheduler, the KV cache and block hashing, each of which the fast engine
tests must kill. A mutant is one exact textual replacement in one source file; a snippet that is
not found exactly once is an error, so a refactor has to update this list.

    python -m tests.engine.mutants          # every mutant: killed or survived (exit 1 if any survive)
    python -m tests.engine.mutants NAME     # pytest on the fast tests with mutant NAME loaded

A mutant is loaded in a fresh interpreter: its module is executed from the mutated text and put
in sys.modules before pytest imports anything, so the checkout itself is never written.
"""

from __future__ import annotations

import importlib
import subprocess
import sys
import time
import types
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TESTS = ["tests/engine/test_scheduler_properties.py", "tests/engine/test_block_pool.py"]
PYTEST_ARGS = [
    "-x",
    "-q",
    "-p",
    "no:cacheprovider",
    "-W",
    "ignore::pytest.PytestAssertRewriteWarning",
    *TESTS,
]
NO_TESTS_FAILED = (0, 5)  # pytest: all passed, nothing collected


@dataclass(frozen=True)
class Mutant:
    name: str
    module: str  # dotted name of the mutated module
    original: str  # exact snippet, present once in the module's source
    replacement: str

    @property
    def path(self) -> Path:
        return ROOT / (self.module.replace(".", "/") + ".py")

    def source(self) -> str:
        text = self.path.read_text()
        count = text.count(self.original)
        if count != 1:
            raise LookupError(f"mutant {self.name}: snippet found {count} times in {self.path}")
        return text.replace(self.original, self.replacement)


SCHED, KV, POOL, HASH = (
    "mmserve.engine.scheduler",
    "mmserve.engine.kv_cache_manager",
    "mmserve.engine.block_pool",
    "mmserve.engine.block_hash",
)
MUTANTS = [
    Mutant(
        "token_budget_ignored",
        SCHED,
        "num_new = min(request.num_tokens - request.num_computed_tokens, budget)",
        "num_new = request.num_tokens - request.num_computed_tokens",
    ),
    Mutant(
        "max_num_seqs_ignored",
        SCHED,
        "if len(self.running) >= self.config.max_num_seqs or self.waiting[0].num_pending:",
        "if self.waiting[0].num_pending:",
    ),
    Mutant(
        "preempt_oldest",
        SCHED,
        "victim = self.running.pop()  # the newest request goes first",
        "victim = self.running.pop(0)",
    ),
    Mutant(
        "preempted_keeps_computed_tokens",
        SCHED,
        "request.status = RequestStatus.PREEMPTED\n        request.num_computed_tokens = 0",
        "request.status = RequestStatus.PREEMPTED",
    ),
    Mutant(
        "ignore_eos_ignored",
        SCHED,
        "if token in request.eos_token_ids and not params.ignore_eos:",
        "if token in request.eos_token_ids:",
    ),
    Mutant(
        "full_prefix_hit_leaves_nothing_to_compute",
        KV,
        "max_blocks = (request.num_tokens - 1) // self.block_size",
        "max_blocks = request.num_tokens // self.block_size",
    ),
    Mutant(
        "block_free_skipped",
        KV,
        "self.pool.free(reversed(blocks))",
        "self.pool.free(reversed(blocks[1:]))",
    ),
    Mutant(
        "free_block_not_listed_free",
        POOL,
        "free_list[block.block_id] = None",
        "pass",
    ),
    Mutant(
        "reused_block_stays_cached",
        POOL,
        "            self._evict(block)\n            block.ref_cnt = 1",
        "            block.ref_cnt = 1",
    ),
    Mutant(
        "cache_hit_stays_on_free_list",
        POOL,
        "self._free_cached.pop(block.block_id)",
        "pass",
    ),
    Mutant(
        "image_content_dropped_from_hash",
        HASH,
        'keys.append(f"mm:{ph.content_hash}:{ph.offset - start}")',
        'keys.append(f"mm:{ph.offset - start}")',
    ),
    Mutant(
        "image_offset_dropped_from_hash",
        HASH,
        'keys.append(f"mm:{ph.content_hash}:{ph.offset - start}")',
        'keys.append(f"mm:{ph.content_hash}")',
    ),
    Mutant(
        "cache_salt_dropped_from_hash",
        HASH,
        'keys = [f"salt:{cache_salt}"] if cache_salt and block_index == 0 else []',
        "keys = []",
    ),
    Mutant(
        "hash_not_chained",
        HASH,
        "parent = block_hashes[-1] if block_hashes else ROOT_HASH",
        "parent = ROOT_HASH",
    ),
]
BY_NAME = {m.name: m for m in MUTANTS}


def load(mutant: Mutant) -> None:
    """Executes the mutated module in place of the real one (its package imported first)."""
    package, _, child = mutant.module.rpartition(".")
    parent = importlib.import_module(package)
    module = types.ModuleType(mutant.module)
    module.__file__ = str(mutant.path)
    sys.modules[mutant.module] = module
    code = compile(mutant.source(), str(mutant.path), "exec")
    exec(code, module.__dict__)  # noqa: S102 (our own source, one snippet replaced)
    setattr(parent, child, module)


def run_pytest(mutant: Mutant | None) -> int:
    """In this interpreter: pytest on TESTS with the mutant loaded (None: none), hypothesis
    not shrinking (the first failure is all we need), derandomized (the same verdict each run)
    and without its example database."""
    import pytest
    from hypothesis import Phase, settings

    settings.register_profile(
        "mutants", phases=[Phase.explicit, Phase.generate], database=None, derandomize=True
    )
    settings.load_profile("mutants")
    if mutant is not None:
        load(mutant)
    return int(pytest.main(PYTEST_ARGS))


@dataclass(frozen=True)
class Verdict:
    killer: str | None  # the test that failed (None: the mutant survived)
    seconds: float


def verdict(mutant: Mutant | None, timeout: float = 300) -> Verdict:
    """Runs the fast tests on the mutant in a fresh interpreter (None: on the real code)."""
    mutant_args = [mutant.name] if mutant is not None else ["--none"]
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "tests.engine.mutants", *mutant_args],
        check=False,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if proc.returncode not in (*NO_TESTS_FAILED, 1):  # 2-4: interrupted, internal or usage error
        raise RuntimeError(
            f"{mutant_args[0]}: pytest exited {proc.returncode}\n{proc.stdout[-3000:]}"
        )
    failed = [line.split()[1] for line in proc.stdout.splitlines() if line.startswith("FAILED ")]
    if proc.returncode == 1 and not failed:
        raise RuntimeError(f"{mutant_args[0]}: pytest failed, no test named\n{proc.stdout[-3000:]}")
    return Verdict(failed[0] if failed else None, time.monotonic() - start)


def main(argv: list[str]) -> int:
    if argv and argv[0] != "--none" and argv[0] not in BY_NAME:
        raise SystemExit(f"unknown mutant {argv[0]!r}; valid: --none, {', '.join(BY_NAME)}")
    if argv:
        return run_pytest(BY_NAME.get(argv[0]))
    survived = []
    for mutant in MUTANTS:
        v = verdict(mutant)
        outcome = f"killed by {v.killer.split('/')[-1]}" if v.killer else "SURVIVED"
        print(f"{mutant.name:42s} {v.seconds:5.1f}s  {outcome}", flush=True)
        survived += [] if v.killer else [mutant.name]
    return 1 if survived else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
