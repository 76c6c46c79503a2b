"""Named mutants of the scheduler, the KV cache and block hashing, each of which the fast engine
tests must kill. A mutant is one exact textual replacement in one source file; a snippet that is
not found exactly once is an error, so a refactor has to update this list.

    python -m tests.engine.mutants          # every mutant: killed or survived (exit 1 if any survive)
    python -m tests.engine.mutants NAME     # pytest on the fast tests with mutant NAME loaded

A mutant is loaded in a fresh interpreter (a child forked from one that imported only the heavy
libraries, PRELOAD): its module is executed from the mutated text and put in sys.modules before
pytest imports anything, so the checkout itself is never written.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import subprocess
import sys
import tempfile
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


def run_pytest(mutant: Mutant | None, *args: str) -> int:
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
    return int(pytest.main([*args, *PYTEST_ARGS]))


@dataclass(frozen=True)
class Verdict:
    killer: str | None  # the test that failed (None: the mutant survived)
    seconds: float


def judge(name: str, returncode: int, stdout: str, seconds: float) -> Verdict:
    """The verdict of one pytest run on a mutant (name: for the errors)."""
    if returncode not in (*NO_TESTS_FAILED, 1):  # 2-4: interrupted, internal or usage error
        raise RuntimeError(f"{name}: pytest exited {returncode}\n{stdout[-3000:]}")
    failed = [line.split()[1] for line in stdout.splitlines() if line.startswith("FAILED ")]
    if returncode == 1 and not failed:
        raise RuntimeError(f"{name}: pytest failed, no test named\n{stdout[-3000:]}")
    return Verdict(failed[0] if failed else None, seconds)


def verdict(mutant: Mutant | None, timeout: float = 300) -> Verdict:
    """Runs the fast tests on the mutant in a fresh interpreter (None: on the real code)."""
    name = mutant.name if mutant is not None else "--none"
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "tests.engine.mutants", name],
        check=False,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    return judge(name, proc.returncode, proc.stdout, time.monotonic() - start)


# what every run imports and no mutant touches: imported once by the forking interpreter (most of
# a run's 6 s was these imports; the tests themselves take 0.5-2.5 s)
PRELOAD = ("torch", "transformers", "numpy", "hypothesis", "pytest", "xgrammar", "anyio", "pytest_asyncio",
           "_hypothesis_pytestplugin", "tokenizers", "jinja2", "pydantic", "PIL.Image", "msgspec")


def verdicts(mutants: list[Mutant | None], timeout: float = 600) -> list[Verdict]:
    """verdict() of each mutant, from one interpreter that imports PRELOAD once and forks a child
    per mutant (mmserve itself is imported in each child, after its mutant is loaded); one fresh
    interpreter each where there is no fork."""
    if not hasattr(os, "fork"):
        return [verdict(m, timeout) for m in mutants]
    names = [m.name if m is not None else "--none" for m in mutants]
    proc = subprocess.run(
        [sys.executable, "-m", "tests.engine.mutants", "--fork", *names],
        check=False,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"the forking interpreter exited {proc.returncode}\n{proc.stderr[-3000:]}")
    results = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert [r["name"] for r in results] == names, proc.stdout[-3000:]
    return [Verdict(r["killer"], r["seconds"]) for r in results]


def fork_verdicts(names: list[str]) -> None:
    """In this interpreter: PRELOAD imported, then one forked child per name runs pytest with
    that mutant loaded; prints each verdict as a JSON line."""
    assert not any(m == "mmserve" or m.startswith("mmserve.") for m in sys.modules)
    for module in PRELOAD:
        with contextlib.suppress(ImportError):
            importlib.import_module(module)
    for name in names:
        with tempfile.TemporaryFile("w+") as out:
            sys.stdout.flush()
            start = time.monotonic()
            pid = os.fork()
            if pid == 0:  # the child: its output to the file, its exit code pytest's
                code = 3
                try:
                    os.dup2(out.fileno(), 1)
                    os.dup2(out.fileno(), 2)
                    # asserts not rewritten: only which test fails counts (0.7 s a run)
                    code = run_pytest(BY_NAME.get(name), "--assert=plain", "-p", "no:xdist")
                finally:
                    sys.stdout.flush()
                    sys.stderr.flush()
                    os._exit(code)
            _, status = os.waitpid(pid, 0)
            out.seek(0)
            v = judge(name, os.waitstatus_to_exitcode(status), out.read(), time.monotonic() - start)
        print(json.dumps({"name": name, "killer": v.killer, "seconds": v.seconds}), flush=True)


def main(argv: list[str]) -> int:
    fork = argv[:1] == ["--fork"]
    for name in argv[1:] if fork else argv[:1]:
        if name != "--none" and name not in BY_NAME:
            raise SystemExit(f"unknown mutant {name!r}; valid: --none, {', '.join(BY_NAME)}")
    if fork:
        fork_verdicts(argv[1:])
        return 0
    if argv:
        return run_pytest(BY_NAME.get(argv[0]))
    survived = []
    for mutant, v in zip(MUTANTS, verdicts(list(MUTANTS)), strict=True):
        outcome = f"killed by {v.killer.split('/')[-1]}" if v.killer else "SURVIVED"
        print(f"{mutant.name:42s} {v.seconds:5.1f}s  {outcome}", flush=True)
        survived += [] if v.killer else [mutant.name]
    return 1 if survived else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
