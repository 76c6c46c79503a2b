"""CUDA graphs for decode-only steps.

A decode step at small batch launches hundreds of small kernels; replaying a captured graph
removes the launch overhead, which otherwise exceeds the GPU time itself. One graph per
captured batch size; a step of B decodes runs the smallest graph of size >= B, with the
extra rows padded (slot -1: no cache write; context length 1; output ignored). Inputs live
in persistent buffers that every graph reads. The attention launch shape (its split-KV count)
follows max_seq_len, which a graph freezes: small batches, where split-KV matters, get one
graph per context bucket (SEQ_BUCKETS, then the model's limit), so a short context is not
split into empty pieces and merged; larger batches get one graph at the model's limit.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from mmserve.attention import AttentionMetadata
from mmserve.models.base import CausalLM

logger = logging.getLogger(__name__)

DEFAULT_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)
CAPTURE_TIME_LIMIT_S = 120.0  # stop capturing more sizes past this (start-up bound)
SEQ_BUCKETS = (256, 1024)  # max_seq_len buckets below the model's limit, for small batches
BUCKETED_MAX_BATCH = 8  # batches up to this size get a graph per bucket


class DecodeGraphs:
    def __init__(
        self,
        model: CausalLM,
        kv_caches: list[torch.Tensor],
        max_batch: int,
        max_blocks_per_seq: int,
        max_seq_len: int,
        device: torch.device,
        sizes: tuple[int, ...] = DEFAULT_SIZES,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.sizes = sorted(s for s in sizes if s <= max_batch) or [max_batch]
        n = self.sizes[-1]
        self.max_seq_len = max_seq_len
        i32: dict[str, Any] = {"dtype": torch.int32, "device": device}
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.int64, device=device)
        self.seq_lens = torch.ones(n, **i32)
        self.block_tables = torch.zeros(n, max_blocks_per_seq, **i32)
        self.query_start_loc = torch.arange(n + 1, **i32)  # one token per request, always
        self._graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}  # (size, max_seq_len)
        self._outputs: dict[tuple[int, int], torch.Tensor] = {}
        self._pool: Any = None  # the memory pool the first capture makes, shared by the rest

    def buckets(self, size: int) -> list[int]:
        """The frozen max_seq_len values captured for a batch size, ascending."""
        small = [b for b in SEQ_BUCKETS if b < self.max_seq_len] if size <= BUCKETED_MAX_BATCH else []
        return [*small, self.max_seq_len]

    def _meta(self, size: int, max_seq_len: int) -> AttentionMetadata:
        return AttentionMetadata(
            query_start_loc=self.query_start_loc[: size + 1],
            seq_lens=self.seq_lens[:size],
            block_tables=self.block_tables[:size],
            slot_mapping=self.slot_mapping[:size],
            max_query_len=1,
            max_seq_len=max_seq_len,
            query_lens_cpu=[1] * size,
            seq_lens_cpu=[1] * size,
        )

    def _forward(self, size: int, max_seq_len: int) -> torch.Tensor:
        meta = self._meta(size, max_seq_len)
        return self.model.forward(self.input_ids[:size], self.positions[:size], self.kv_caches, meta)

    @torch.inference_mode()
    def capture(self) -> None:
        """Captures the largest size first so smaller graphs reuse its memory pool."""
        start = time.monotonic()
        free_before = torch.cuda.mem_get_info()[0]
        for size in reversed(self.sizes):
            if time.monotonic() - start > CAPTURE_TIME_LIMIT_S:
                logger.warning("CUDA graph capture stopped at the time limit before size %d", size)
                break
            for bucket in reversed(self.buckets(size)):
                self._forward(size, bucket)  # warm-up: compiles kernels outside the capture
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self._pool):
                    self._outputs[size, bucket] = self._forward(size, bucket)
                self._pool = graph.pool()
                self._graphs[size, bucket] = graph
        torch.cuda.synchronize()
        used = (free_before - torch.cuda.mem_get_info()[0]) / 2**20
        logger.info(
            "captured %d CUDA graphs (batch, max_seq_len %s) in %.1fs using %.0f MiB",
            len(self._graphs), sorted(self._graphs), time.monotonic() - start, used,
        )

    def size_for(self, batch: int) -> int | None:
        return next((s for s in sorted({s for s, _ in self._graphs}) if s >= batch), None)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor | None:
        """Replays the graph for a decode-only batch; None when no graph fits it."""
        batch = input_ids.shape[0]
        size = self.size_for(batch)
        if size is None or meta.max_seq_len > self.max_seq_len:
            return None
        width = meta.block_tables.shape[1]
        if width > self.block_tables.shape[1]:
            return None
        bucket = next(b for b in self.buckets(size) if b >= meta.max_seq_len)
        if (size, bucket) not in self._graphs:
            return None
        self.input_ids[:batch].copy_(input_ids)
        self.positions[:batch].copy_(positions)
        self.slot_mapping[:batch].copy_(meta.slot_mapping)
        self.slot_mapping[batch:size].fill_(-1)
        self.seq_lens[:batch].copy_(meta.seq_lens)
        self.seq_lens[batch:size].fill_(1)
        self.block_tables[:batch, :width].copy_(meta.block_tables)
        self._graphs[size, bucket].replay()
        return self._outputs[size, bucket][:batch]
