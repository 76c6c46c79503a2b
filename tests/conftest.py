"""Loaded before every test module. Without CUDA, Triton kernels run under the interpreter.

@triton.jit picks the interpreter when a function is defined, and `import torch` may import
triton itself (torch._native registers Triton ops, depending on import order), defining
triton.language's own jit functions then; so the switch is set here, before any test module
imports torch (tests/kernels/conftest.py checks it)."""

import os
import shutil

if shutil.which("nvidia-smi") is None:  # no GPU: torch is not imported yet to ask it
    os.environ.setdefault("TRITON_INTERPRET", "1")
