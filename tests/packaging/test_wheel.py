"""A plain (non-editable) install carries mmserve.kernels and mmserve.processors inside mmserve and
puts no top-level package of its own beside it (a top-level `kernels` shadowed the package of that
name that transformers imports)."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_wheel_maps_kernels_and_processors(tmp_path: Path) -> None:
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path), str(ROOT)],
        check=True,
    )
    (wheel,) = tmp_path.glob("mmserve-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for required in (
        "mmserve/kernels/paged_attention.py",
        "mmserve/kernels/cpu/gguf_gemm.c",  # (built at first use)
        "mmserve/kernels/cpu/gguf_cpu.h",
        "mmserve/processors/detokenizer.py",
        "mmserve/processors/tool_parsers/hermes.py",
        "mmserve/structured_output/manager.py",
        "mmserve/engine/scheduler.py",
    ):
        assert required in names, required
    assert not any(n.startswith(("kernels/", "processors/", "tests/")) for n in names)
    # and it imports from the wheel alone, outside the source tree
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), str(wheel)], check=True)
    code = (
        "import mmserve.kernels.rmsnorm as k, mmserve.processors.detokenizer as p, sys;"
        "assert k.__file__.startswith(sys.argv[1]) and p.__file__.startswith(sys.argv[1]), (k.__file__, p.__file__)"
    )
    env = {"PYTHONPATH": str(target), "PATH": "/usr/bin:/bin"}
    subprocess.run([sys.executable, "-c", code, str(target)], check=True, cwd=tmp_path, env=env)
