"""The CPU library (mmserve/kernels/cpu/*.c) built with AddressSanitizer and UBSan, and every
GGUF product path through it: each type, K of one to several blocks, 1-41 output channels (a
partial panel), 1-130 rows, the outer-product panels on and off; each product against the
gguf package's dequantised weights. An out-of-bounds read of a block (the transposing loads
read 16 bytes at a time) or of x stops it with ASan's report. Run from the repository root:

    PYTHONPATH=. python scripts/asan_cpu_lib.py

(it re-runs itself with libasan and libubsan preloaded; gcc only).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

# (-O1 -g: sanitized code whose reports name the lines)
FLAGS = ("-O1", "-g", "-fsanitize=address,undefined", "-fno-omit-frame-pointer")


def sweep(lib_path: Path) -> int:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # (tests' random_blocks import the Triton kernels' modules)
    import torch

    from mmserve.kernels import cpu_gguf, cpu_lib
    from mmserve.kernels.gguf_blocks import FORMATS, gguf_dequantize_ref
    from tests.kernels.test_gguf_gemm import random_blocks

    lib = cpu_lib.load(lib_path)
    done = 0
    for qtype in FORMATS:
        for k in (256, 512) if qtype.endswith("_K") else (32, 224, 576):
            for n in (1, 16, 17, 41):
                blocks = random_blocks(qtype, n, k, n).cpu().clone()  # (exactly its bytes: ASan's redzones)
                weight = gguf_dequantize_ref(blocks, qtype).double()
                for panels in (True, False):
                    cpu_gguf.PANELS = panels
                    for rows in (1, 2, 3, 4, 5, 15, 16, 17, 33, 130):
                        x = torch.randn(rows, k)
                        out = cpu_gguf.gguf_gemm_cpu(x, blocks, qtype, lib=lib).double()
                        expected = x.double() @ weight.t()
                        tolerance = 1e-4 * expected.abs().max().item() + 1e-6
                        assert torch.allclose(out, expected, rtol=1e-4, atol=tolerance), (qtype, k, n, rows, panels)
                        done += 1
    return done


def main() -> None:
    if len(sys.argv) > 1:  # (the re-run, sanitizers preloaded)
        print(f"{sweep(Path(sys.argv[1]))} products, no sanitizer report")
        return
    from mmserve.kernels import cpu_lib

    lib = cpu_lib.build(Path(tempfile.mkdtemp()), flags=FLAGS)
    runtimes = [subprocess.run(["gcc", f"-print-file-name={name}"], check=True, capture_output=True,
                               text=True).stdout.strip() for name in ("libasan.so", "libubsan.so")]  # fmt: skip
    env = dict(os.environ, LD_PRELOAD=":".join(runtimes), ASAN_OPTIONS="detect_leaks=0")
    sys.exit(subprocess.run([sys.executable, __file__, str(lib)], check=False, env=env).returncode)


if __name__ == "__main__":
    main()
