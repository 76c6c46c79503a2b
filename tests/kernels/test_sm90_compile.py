"""The GGUF kernels (and w4a16's, FP8's rows kernel, paged attention and the host gate) compile for sm_90, checked on any machine (tests/kernels/sm90_compile.py):
Triton's compiler refuses code its interpreter runs, so the CPU tests alone cannot tell."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from mmserve.kernels.gguf_blocks import FORMATS

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # a cover of the variants (sm90_compile.cases): minutes with an empty Triton cache
def test_gguf_kernels_compile_for_sm90() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run(
        [sys.executable, "-m", "tests.kernels.sm90_compile"],
        check=False, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    # and w4a16's, DP4A's q8, FP8's rows, paged attention, the host gate
    assert done.stdout.count("compiled for sm_90") == len(FORMATS) + 5
