"""The committed stubs match the protos (scripts/gen_protos.sh --check), and buf lint is clean
where buf is installed (scripts/setup.sh --test puts it in .tools/buf)."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LOCAL_BUF = ROOT / ".tools" / "buf" / "node_modules" / ".bin" / "buf"  # where lint_protos.sh looks


def _run(script: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHON": sys.executable}
    return subprocess.run(
        ["bash", str(ROOT / "scripts" / script), *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=False,
    )


@pytest.mark.skipif(importlib.util.find_spec("grpc_tools") is None, reason="no grpcio-tools")
def test_generated_stubs_are_up_to_date() -> None:
    result = _run("gen_protos.sh", "--check")
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.skipif(
    not (os.environ.get("BUF") or LOCAL_BUF.exists() or shutil.which("buf")),
    reason="buf not installed (scripts/setup.sh --test, or set BUF)",
)
def test_buf_lint_is_clean() -> None:
    result = _run("lint_protos.sh", "--strict")
    assert result.returncode == 0, result.stdout + result.stderr


def test_generated_imports_resolve_inside_the_sdk() -> None:
    from mmserve_client.v1 import generate_pb2, inference_pb2_grpc

    assert generate_pb2.DESCRIPTOR.name == "mmserve/v1/generate.proto"  # canonical names
    assert hasattr(inference_pb2_grpc, "InferenceStub")
    assert "mmserve.v1" not in sys.modules  # nothing imported a top-level mmserve.v1
