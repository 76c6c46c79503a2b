"""Kernel tests run on CUDA when there is one, else under the Triton interpreter on CPU.

The interpreter computes bfloat16 wrongly, so bf16 is tested on CUDA only.
"""

import os
import sys

import pytest
import torch

if not torch.cuda.is_available():
    # @triton.jit picks the interpreter when a kernel is defined, so this must run before any
    # kernel module is imported (a test module collected earlier may have done so). Modules
    # without triton (paged_ref, the CPU attention's maths) define no kernel.
    imported = sorted(
        name
        for name, module in sys.modules.items()
        if name.startswith("mmserve.kernels.") and "triton" in vars(module)
    )
    if imported and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError(
            f"{imported} were imported before tests/kernels/conftest.py set TRITON_INTERPRET=1; "
            "set it in a conftest.py that pytest loads earlier (tests/conftest.py)"
        )
    os.environ["TRITON_INTERPRET"] = "1"

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
FLOAT_DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE.type == "cuda" else [])
# Tolerances against an fp32 reference of the same (rounded) inputs.
TOLERANCES = {
    torch.float32: {"atol": 2e-5, "rtol": 1e-5},
    torch.float16: {"atol": 2e-3, "rtol": 2e-3},
    torch.bfloat16: {"atol": 1.6e-2, "rtol": 1.6e-2},
}


@pytest.fixture
def device() -> torch.device:
    return DEVICE


@pytest.fixture(params=FLOAT_DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def dtype(request: pytest.FixtureRequest) -> torch.dtype:
    return request.param


@pytest.fixture
def tol(dtype: torch.dtype) -> dict[str, float]:
    return TOLERANCES[dtype]


@pytest.fixture
def tol_f32() -> dict[str, float]:
    """For tests pinned to float32 (taking `tol` would parametrize them over dtypes)."""
    return TOLERANCES[torch.float32]


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)
