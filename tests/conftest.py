"""Loaded before every test module. Without CUDA, Triton kernels run under the interpreter.

@triton.jit picks the interpreter when a function is defined, and `import torch` may import
triton itself (torch._native registers Triton ops, depending on import order), defining
triton.language's own jit functions then; so the switch is set here, before any test module
imports torch (tests/kernels/conftest.py checks it)."""

import os
import shutil

if shutil.which("nvidia-smi") is None:  # no GPU: torch is not imported yet to ask it
    os.environ.setdefault("TRITON_INTERPRET", "1")

# pytest-xdist runs several workers on few cores: each worker (and every engine or server
# process it starts) gets its share of the cores as intra-op threads, not all of them; on the
# 2-core CI machine two workers of two OpenMP threads each spin against each other, several
# times slower than one thread each
_workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
if _workers > 1:
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // _workers)))

# Engines freeze the start-up heap out of the garbage collector (mmserve.heap): one full
# collection per engine start, and in a test worker that starts many engines and drops some
# without shutting them down, frozen cycles that are never freed. Tests start engines with it
# off unless they say otherwise; tests/engine/test_heap.py turns it on.
os.environ.setdefault("MMSERVE_GC_FREEZE", "0")


def pytest_addoption(parser):  # type: ignore[no-untyped-def]
    parser.addoption(
        "--pdl", action="store_true",
        help="launch the Triton kernels with programmatic dependent launch (kernels._common.PDL; "
        "CUDA, compute capability 9.0 or later): the GPU tests under it",
    )  # fmt: skip


def pytest_configure(config):  # type: ignore[no-untyped-def]
    if config.getoption("--pdl"):  # (set before any test runs: kernels read it at each launch)
        from mmserve.kernels import _common

        _common.PDL = True
