"""Runs `mmserve bench` with module switches set first, for A/B runs of a lever that has no
setting of its own (a kernel's split rule, a fusion) in one GPU call:

    python scripts/ab_switch.py mmserve.kernels.fp8_gemm.SPLIT_BELOW=0 \
        mmserve.models.quantized_input.FUSE_ACTIVATION_QUANT=False -- latency --quantization fp8

Each NAME=VALUE sets module NAME's last attribute to VALUE (a Python literal). Only engines in
this process see it: not with --engine-process.
"""

from __future__ import annotations

import ast
import importlib
import sys


def set_switch(assignment: str) -> None:
    name, sep, value = assignment.partition("=")
    module, _, attr = name.rpartition(".")
    if not sep or not module:
        raise SystemExit(f"expected MODULE.ATTR=VALUE, got {assignment!r}")
    target = importlib.import_module(module)
    if not hasattr(target, attr):
        raise SystemExit(f"{module} has no {attr}")
    setattr(target, attr, ast.literal_eval(value))


def main(argv: list[str]) -> None:
    if "--" not in argv:
        raise SystemExit(__doc__)
    cut = argv.index("--")
    for assignment in argv[:cut]:
        set_switch(assignment)
    from mmserve.bench.cli import main as bench

    sys.argv = ["mmserve", "bench", *argv[cut + 1 :]]
    bench()


if __name__ == "__main__":
    main(sys.argv[1:])
