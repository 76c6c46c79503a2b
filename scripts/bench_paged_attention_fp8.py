"""Decode paged attention over a bf16 and an FP8 cache on CUDA, by decode tiling (block_m,
block_n, num_warps, num_stages at head_dim 128): one JSON line per case, the do_bench time and
the KV bytes read per microsecond. Llama-3-8B's heads (32 q / 8 kv, head_dim 128), 16-token
blocks in random order.

    python scripts/bench_paged_attention_fp8.py
"""

from __future__ import annotations

import functools
import json

import torch
import triton

from mmserve.kernels import paged_attention as pa

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 32, 8, 128, 16
CASES = [(64, 1056), (16, 4096), (1, 8192)]  # batch, context
TILES = [None, (16, 64, 4, 2), (16, 128, 4, 2), (16, 128, 4, 3), (16, 128, 8, 2), (16, 32, 4, 4)]


def main() -> None:
    torch.manual_seed(0)
    defaults = {"bf16": dict(pa._DECODE_TILES), "fp8": dict(pa._FP8_DECODE_TILES)}
    for batch, ctx in CASES:
        per = triton.cdiv(ctx, BLOCK)
        blocks = batch * per + 1
        q = torch.randn(batch, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
        caches = {"bf16": [torch.randn(blocks, BLOCK, KV_HEADS, HEAD_DIM, device="cuda",
                                       dtype=torch.bfloat16) for _ in range(2)]}  # fmt: skip
        caches["fp8"] = [c.to(torch.float8_e4m3fn) for c in caches["bf16"]]
        table = torch.randperm(blocks - 1, device="cuda", dtype=torch.int32)[: batch * per]
        seq_lens = torch.full((batch,), ctx, device="cuda", dtype=torch.int32)
        starts = torch.arange(batch + 1, device="cuda", dtype=torch.int32)
        for cache, (k, v) in caches.items():
            tiles_of = pa._DECODE_TILES if cache == "bf16" else pa._FP8_DECODE_TILES
            for tiles in TILES:
                tiles_of[128] = tiles or defaults[cache][128]

                run = functools.partial(
                    pa.paged_attention, q, k, v, starts, seq_lens, table.view(batch, per),
                    max_query_len=1, max_seq_len=ctx, scale=HEAD_DIM**-0.5,
                )  # fmt: skip
                us = 1e3 * triton.testing.do_bench(run, warmup=50, rep=300)
                kv_bytes = 2 * batch * ctx * KV_HEADS * HEAD_DIM * k.element_size()
                print(json.dumps({"batch": batch, "context": ctx, "cache": cache,
                                  "tiles": tiles_of[128], "us": round(us, 1),
                                  "gbs": round(kv_bytes / us / 1e3)}), flush=True)  # fmt: skip
            tiles_of[128] = defaults[cache][128]


if __name__ == "__main__":
    main()
