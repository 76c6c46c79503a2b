"""CUDA graphs for decode-only steps, for decoder steps with prefill tokens, and for encoder
steps.

A decode step at small batch launches hundreds of small kernels; replaying a captured graph
removes the launch overhead, which otherwise exceeds the GPU time itself. One graph per
captured batch size; a step of B decodes runs the smallest graph of size >= B, with the
extra rows padded (slot -1: no cache write; context length 1; output ignored). Inputs live
in persistent buffers that every graph reads. The attention launch shape (its split-KV count)
follows max_seq_len, which a graph freezes: small batches, where split-KV matters, get one
graph per context bucket (SEQ_BUCKETS, then the model's limit), so a short context is not
split into empty pieces and merged; larger batches get one graph at the model's limit.

An encoder step (BERT, XLM-RoBERTa: whole inputs, no KV cache) launches about ten kernels per
layer, whose host time (~3.4 ms for a bert-base step, H200) about equals their GPU time and
holds the engine thread, so encoders get graphs too (EncoderGraphs): one per token-count
bucket, the step padded up to it with zero-length requests and pad tokens. A decoder's steps
with prefill tokens (a short prompt, a prompt mostly in the prefix cache, a prefill chunk with
decodes beside it) get the same treatment up to the prefill_graph_tokens setting (MixedGraphs),
their pad tokens writing no cache.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from functools import partial
from typing import Any

import torch

from mmserve.attention import AttentionMetadata
from mmserve.models.base import CausalLM
from mmserve.models.qwen2_vl_vision import VisionPlan, VisionTransformer

logger = logging.getLogger(__name__)

DEFAULT_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)
CAPTURE_TIME_LIMIT_S = 120.0  # stop capturing more sizes past this (start-up bound)
SEQ_BUCKETS = (256, 1024)  # max_seq_len buckets below the model's limit, for small batches
BUCKETED_MAX_BATCH = 8  # batches up to this size get a graph per bucket


class _Capture:
    """One start-up capture: its time limit, the memory pool the first graph makes (the
    largest, so the rest fit in it), and the log line that closes it."""

    def __init__(self) -> None:
        self.start = time.monotonic()
        self.free_before = torch.cuda.mem_get_info()[0]
        self.pool: Any = None

    def out_of_time(self, next_one: str) -> bool:
        late = time.monotonic() - self.start > CAPTURE_TIME_LIMIT_S
        if late:
            logger.warning("CUDA graph capture stopped at the time limit before %s", next_one)
        return late

    def graph(self, forward: Callable[[], torch.Tensor]) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """forward() run once (its kernels compile outside the capture), then captured; the
        graph and its output tensor."""
        forward()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        # thread_local: another model's engine thread in this process may launch work meanwhile
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            out = forward()
        self.pool = graph.pool()
        return graph, out

    def done(self, what: str) -> None:
        torch.cuda.synchronize()
        used = (self.free_before - torch.cuda.mem_get_info()[0]) / 2**20
        logger.info("captured %s in %.1fs using %.0f MiB", what, time.monotonic() - self.start, used)


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
        mrope: bool = False,
        query_len: int = 1,
    ) -> None:
        """mrope: positions are [3, batch] (M-RoPE models), not [batch]. query_len: tokens per
        request (speculative decoding: 1 + k, its guesses checked; see run_padded)."""
        self.model = model
        self.kv_caches = kv_caches
        self.sizes = sorted(s for s in sizes if s <= max_batch) or [max_batch]
        n = self.sizes[-1]
        self.max_seq_len = max_seq_len
        self.query_len = q = query_len
        self.device = device
        i32: dict[str, Any] = {"dtype": torch.int32, "device": device}
        self.input_ids = torch.zeros(n * q, dtype=torch.int64, device=device)
        shape = (3, n * q) if mrope else (n * q,)
        self.positions = torch.zeros(shape, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((n * q,), -1, dtype=torch.int64, device=device)
        self.seq_lens = torch.full((n,), q, **i32)
        self.block_tables = torch.zeros(n, max_blocks_per_seq, **i32)
        # query_len tokens per request, always
        self.query_start_loc = torch.arange(0, n * q + 1, q, **i32)
        self._graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}  # (size, max_seq_len)
        self._outputs: dict[tuple[int, int], torch.Tensor] = {}

    def buckets(self, size: int) -> list[int]:
        """The frozen max_seq_len values captured for a batch size, ascending."""
        small = [b for b in SEQ_BUCKETS if b < self.max_seq_len] if size <= BUCKETED_MAX_BATCH else []
        return [*small, self.max_seq_len]

    def _meta(
        self, size: int, max_seq_len: int, seq_lens_cpu: list[int] | None = None
    ) -> AttentionMetadata:
        """seq_lens_cpu: the host copy of seq_lens, for an eager run (the graphs' kernels
        read the device tensors only)."""
        q = self.query_len
        return AttentionMetadata(
            query_start_loc=self.query_start_loc[: size + 1],
            seq_lens=self.seq_lens[:size],
            block_tables=self.block_tables[:size],
            slot_mapping=self.slot_mapping[: size * q],
            max_query_len=q,
            max_seq_len=max_seq_len,
            query_lens_cpu=[q] * size,
            seq_lens_cpu=seq_lens_cpu or [q] * size,
        )

    def _forward(
        self, size: int, max_seq_len: int, seq_lens_cpu: list[int] | None = None
    ) -> torch.Tensor:
        meta = self._meta(size, max_seq_len, seq_lens_cpu)
        tokens = size * self.query_len
        positions = self.positions[..., :tokens]
        return self.model.forward(self.input_ids[:tokens], positions, self.kv_caches, meta)

    @torch.inference_mode()
    def capture(self) -> None:
        """Captures the largest size first so smaller graphs reuse its memory pool."""
        capture = _Capture()
        for size in reversed(self.sizes):
            if capture.out_of_time(f"batch size {size}"):
                break
            for bucket in reversed(self.buckets(size)):
                key = (size, bucket)
                self._graphs[key], self._outputs[key] = capture.graph(partial(self._forward, *key))
        capture.done(f"{len(self._graphs)} CUDA graphs (batch, max_seq_len {sorted(self._graphs)})")

    def size_for(self, batch: int) -> int | None:
        return next((s for s in sorted({s for s, _ in self._graphs}) if s >= batch), None)

    def run_padded(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor | None:
        """Replays the graph of query_len tokens per request for a batch whose requests have
        at most that many (speculative decoding: 1 token and its guesses); None when none
        fits. Request r's tokens go to rows r * query_len + j; the rows after them are
        padding: no cache write (slot -1), causally after the real rows (which see only
        their own prefix: each seq_len grows by the padding), and not read back. Before
        capture() (no GPU) the same padded forward runs eagerly, so tests see the layout."""
        q, qlens = self.query_len, meta.query_lens_cpu
        batch = len(qlens)
        size = self.size_for(batch) if self._graphs else next((s for s in self.sizes if s >= batch), None)
        padded_max = meta.max_seq_len + q - min(qlens)
        if size is None or max(qlens) > q or padded_max > self.max_seq_len:
            return None
        width = meta.block_tables.shape[1]
        if width > self.block_tables.shape[1] or positions.dim() != 1:
            return None
        bucket = next(b for b in self.buckets(size) if b >= padded_max)
        graph = self._graphs.get((size, bucket))
        if graph is None and self._graphs:
            return None
        rows = [r * q + j for r, n in enumerate(qlens) for j in range(n)]
        host = torch.tensor(rows + [q - n for n in qlens], dtype=torch.int64)
        index = host.to(self.device, non_blocking=True)
        real, pad = index[: len(rows)], index[len(rows) :].to(torch.int32)
        self.slot_mapping[: size * q].fill_(-1)
        self.slot_mapping[real] = meta.slot_mapping
        self.input_ids[real] = input_ids
        self.positions[real] = positions
        self.seq_lens[:batch].copy_(meta.seq_lens + pad)
        self.seq_lens[batch:size].fill_(q)
        self.block_tables[:batch, :width].copy_(meta.block_tables)
        if graph is None:
            lens = [s + q - n for s, n in zip(meta.seq_lens_cpu, qlens, strict=True)]
            with torch.inference_mode():
                return self._forward(size, bucket, lens + [q] * (size - batch))[real]
        graph.replay()
        return self._outputs[size, bucket][real]

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor | None:
        """Replays the graph for a decode-only batch; None when no graph fits it."""
        if self.query_len > 1:
            return self.run_padded(input_ids, positions, meta)
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
        self.positions[..., :batch].copy_(positions)
        self.slot_mapping[:batch].copy_(meta.slot_mapping)
        self.slot_mapping[batch:size].fill_(-1)
        self.seq_lens[:batch].copy_(meta.seq_lens)
        self.seq_lens[batch:size].fill_(1)
        self.block_tables[:batch, :width].copy_(meta.block_tables)
        self._graphs[size, bucket].replay()
        return self._outputs[size, bucket][:batch]


# token counts of the captured encoder steps: those below the step budget, and the budget itself
ENCODER_TOKEN_SIZES = (64, 128, 256, 512, 1024, 1536, 2048, 3072, 4096, 6144, 8192, 12288, 16384)
# token counts of the captured decoder steps with prefill tokens (small prefills, prefix hits,
# mixed steps), up to the prefill_graph_tokens setting (ModelConfig.prefill_graph_tokens_for);
# steps 12.5% apart at most above 256
MIXED_TOKEN_SIZES = (16, 32, 48, 64, 96, 128, 192, 256, 320, 384, 448, 512, 576, 640, 768, 896, 1024,
                     1280, 1536, 1792, 2048)  # fmt: skip


class _TokenGraphs:
    """Graphs of whole steps by token count, shared by EncoderGraphs and MixedGraphs. A step
    of T tokens in R requests runs the graph of the smallest size >= T; its rows T.. are pad
    tokens at position 0, in no request, and its requests R.. are empty (query_start_loc T),
    which attention skips, so they change no real row (every other layer works row by row).
    The attention launch freezes max_query_len (it steers tiling only).

    Until capture() (which needs CUDA) run() runs the same padded forward eagerly, so the
    padding is tested where there is no GPU."""

    what = "CUDA graphs"  # (the capture's log line)

    def __init__(
        self, model: CausalLM, sizes: list[int], max_reqs: int, device: torch.device, mrope: bool = False
    ) -> None:
        self.model = model
        self.sizes = sizes
        self.max_reqs = max_reqs
        # the largest step's tokens (0: none, a step budget below every size)
        self.capacity = n = self.sizes[-1] if self.sizes else 0
        self.pad_id = model.pad_token_id or 0
        self.input_ids = torch.full((n,), self.pad_id, dtype=torch.int64, device=device)
        self.positions = torch.zeros((3, n) if mrope else (n,), dtype=torch.int64, device=device)
        self.query_start_loc = torch.zeros(self.reqs_for(n) + 1, dtype=torch.int32, device=device)
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._outputs: dict[int, torch.Tensor] = {}

    def reqs_for(self, size: int) -> int:
        """Requests a graph of size tokens holds (each has at least one token)."""
        return min(self.max_reqs, size)

    def _forward(self, size: int) -> torch.Tensor:
        raise NotImplementedError

    @torch.inference_mode()
    def capture(self) -> None:
        """Captures every size, the largest first so the rest reuse its memory pool."""
        capture = _Capture()
        for size in reversed(self.sizes):
            if capture.out_of_time(f"{size} tokens"):
                break
            self._graphs[size], self._outputs[size] = capture.graph(partial(self._forward, size))
        capture.done(f"{len(self._graphs)} {self.what} (tokens {sorted(self._graphs)})")

    def _padded(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> int | None:
        """Fills the shared inputs with the step, padded to a size; the size, or None when no
        graph fits the step (or was captured for it)."""
        num_tokens, num_reqs = input_ids.shape[0], meta.num_reqs
        size = next((s for s in self.sizes if s >= num_tokens), None)
        if size is None or num_reqs > self.reqs_for(size) or positions.dim() != self.positions.dim():
            return None
        if self._graphs and size not in self._graphs:
            return None  # not captured (the time limit)
        self.input_ids[:num_tokens].copy_(input_ids)
        self.input_ids[num_tokens:size].fill_(self.pad_id)
        self.positions[..., :num_tokens].copy_(positions)
        self.positions[..., num_tokens:size].zero_()
        self.query_start_loc[: num_reqs + 1].copy_(meta.query_start_loc)
        self.query_start_loc[num_reqs + 1 : self.reqs_for(size) + 1].fill_(num_tokens)
        return size

    def _replay(self, size: int, num_tokens: int) -> torch.Tensor:
        """The padded step's real rows: the graph replayed, or (not captured) run eagerly."""
        graph = self._graphs.get(size)
        if graph is None:
            with torch.inference_mode():
                return self._forward(size)[:num_tokens]
        graph.replay()
        return self._outputs[size][:num_tokens]


class EncoderGraphs(_TokenGraphs):
    """CUDA graphs for encoder steps (a model with uses_kv_cache False and the Triton
    attention backend), padded as _TokenGraphs says; max_query_len frozen at min(size,
    max_len). A step with more tokens than the largest size (one input over the budget) runs
    eagerly."""

    what = "encoder CUDA graphs"

    def __init__(
        self,
        model: CausalLM,
        max_tokens: int,
        max_reqs: int,
        max_len: int,
        device: torch.device,
        sizes: tuple[int, ...] = ENCODER_TOKEN_SIZES,
    ) -> None:
        super().__init__(model, sorted({s for s in sizes if s < max_tokens} | {max_tokens}), max_reqs, device)
        self.max_len = max_len
        self.token_type_ids = torch.zeros(self.capacity, dtype=torch.int64, device=device)

    def _meta(self, size: int) -> AttentionMetadata:
        reqs = self.reqs_for(size)
        starts = self.query_start_loc[: reqs + 1]
        return AttentionMetadata(
            query_start_loc=starts,
            seq_lens=starts[1:],  # unread: an encoder attends over its own rows
            block_tables=starts.new_zeros(reqs, 0),
            slot_mapping=self.positions.new_empty(0),
            max_query_len=min(size, self.max_len),
            max_seq_len=min(size, self.max_len),
            query_lens_cpu=[],
            seq_lens_cpu=[0] * reqs,
            causal=False,
        )

    def _forward(self, size: int) -> torch.Tensor:
        return self.model.forward(
            self.input_ids[:size],
            self.positions[:size],
            [],
            self._meta(size),
            token_type_ids=self.token_type_ids[:size],  # type: ignore[call-arg]
        )

    def run(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        token_type_ids: torch.Tensor | None,
    ) -> torch.Tensor | None:
        """Hidden states [T, hidden] of an encoder step; None when no graph fits it."""
        if meta.max_query_len > self.max_len:
            return None
        size = self._padded(input_ids, positions, meta)
        if size is None:
            return None
        num_tokens = input_ids.shape[0]
        if token_type_ids is None:
            self.token_type_ids[:size].zero_()
        else:
            self.token_type_ids[:num_tokens].copy_(token_type_ids)
            self.token_type_ids[num_tokens:size].zero_()
        return self._replay(size, num_tokens)


class MixedGraphs(_TokenGraphs):
    """CUDA graphs for decoder steps with prefill tokens of at most prefill_graph_tokens
    (a setting, ModelConfig.prefill_graph_tokens_for; MIXED_TOKEN_SIZES up to 2048) tokens in
    all: a prompt mostly found in the prefix cache, a short prompt, a prefill chunk with decodes
    beside it. Eager, such a step is bound by its hundreds of kernel launches
    (issue 23: a full prefix hit took 21.3 ms on the 8B shape against 103.6 ms cold). Padded
    as _TokenGraphs says: the pad tokens write no cache (slot -1); the empty requests have
    seq_len 0. max_query_len is frozen at the size, max_seq_len at the graphs' largest: they
    steer only the attention's tiling and its KV split count (mmserve/kernels/paged_attention.py
    auto_num_splits), chosen for one busy request: a turn after a long cached prompt is a few
    query tiles that would leave most SMs idle unsplit, and a split's range follows each
    request's real length at replay (a short context's spare splits are empty). One graph
    per size holds up to min(size, max_num_seqs) requests."""

    what = "CUDA graphs of steps with prefill tokens"

    def __init__(
        self,
        model: CausalLM,
        kv_caches: list[torch.Tensor],
        max_tokens: int,
        max_reqs: int,
        max_blocks_per_seq: int,
        max_seq_len: int,
        device: torch.device,
        sizes: tuple[int, ...] = MIXED_TOKEN_SIZES,
        mrope: bool = False,
    ) -> None:
        """max_tokens: the largest step captured (the step budget, or prefill_graph_tokens if
        smaller)."""
        super().__init__(model, sorted(s for s in sizes if s <= max_tokens), max_reqs, device, mrope)
        self.kv_caches = kv_caches
        self.max_seq_len = max_seq_len
        n = self.capacity
        reqs = self.reqs_for(n)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.int64, device=device)
        self.seq_lens = torch.zeros(reqs, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(reqs, max_blocks_per_seq, dtype=torch.int32, device=device)
        # an eager run's host copies of the padded step (the reference backend loops on them)
        self._query_lens_cpu: list[int] | None = None
        self._seq_lens_cpu: list[int] | None = None

    def _meta(self, size: int) -> AttentionMetadata:
        reqs = self.reqs_for(size)
        return AttentionMetadata(
            query_start_loc=self.query_start_loc[: reqs + 1],
            seq_lens=self.seq_lens[:reqs],
            block_tables=self.block_tables[:reqs],
            slot_mapping=self.slot_mapping[:size],
            max_query_len=size,
            max_seq_len=self.max_seq_len,
            query_lens_cpu=self._query_lens_cpu or [0] * reqs,
            seq_lens_cpu=self._seq_lens_cpu or [0] * reqs,
            busy_reqs=1,  # (the split count for a long context's few query tiles)
        )

    def _forward(self, size: int) -> torch.Tensor:
        positions = self.positions[..., :size]
        return self.model.forward(self.input_ids[:size], positions, self.kv_caches, self._meta(size))

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor | None:
        """Hidden states [T, hidden] of a decoder step; None when no graph fits it."""
        if not self.sizes or meta.max_seq_len > self.max_seq_len:
            return None
        width = meta.block_tables.shape[1]
        if width > self.block_tables.shape[1]:
            return None
        size = self._padded(input_ids, positions, meta)
        if size is None:
            return None
        num_tokens, num_reqs, reqs = input_ids.shape[0], meta.num_reqs, self.reqs_for(size)
        self.slot_mapping[:num_tokens].copy_(meta.slot_mapping)
        self.slot_mapping[num_tokens:size].fill_(-1)
        self.seq_lens[:num_reqs].copy_(meta.seq_lens)
        self.seq_lens[num_reqs:reqs].zero_()
        self.block_tables[:num_reqs, :width].copy_(meta.block_tables)
        if not self._graphs:  # eager (no GPU): the host copies the reference backend reads
            pad = reqs - num_reqs
            self._query_lens_cpu = [*meta.query_lens_cpu, *[0] * pad]
            self._seq_lens_cpu = [*meta.seq_lens_cpu, *[0] * pad]
        try:
            return self._replay(size, num_tokens)
        finally:
            self._query_lens_cpu = self._seq_lens_cpu = None


MAX_VISION_GRAPHS = 8  # sets of image sizes whose tower graphs are kept (least recently used go)


class VisionGraphs:
    """CUDA graphs of a Qwen2-VL vision tower (models/qwen2_vl_vision.py), one per list of
    image grids, captured the first time a step brings images of those sizes (an app's
    uploads, resized by the processor, mostly share one) and replayed after: eager, the
    tower is bound by its launches (one 448 x 448 image took 14.6 ms on the H200 at the 7B
    shape, about 1.6 ms of FLOPs; BENCHMARKS.md). The tower's plan (what the grids alone
    decide: rotary tables, segments, window order) is made once per graph; its run is device
    work only. Called as the tower is: (patches, grids) -> LM tokens."""

    def __init__(self, tower: VisionTransformer, limit: int = MAX_VISION_GRAPHS) -> None:
        self.tower = tower
        self.limit = limit
        self._graphs: OrderedDict[tuple[tuple[int, int, int], ...], tuple[torch.Tensor, torch.cuda.CUDAGraph, torch.Tensor, VisionPlan]] = OrderedDict()  # fmt: skip
        self._pool: Any = None
        self._eager: set[tuple[tuple[int, int, int], ...]] = set()  # sizes whose capture failed

    @torch.inference_mode()  # (the static inputs are inference tensors, updated in place)
    def __call__(self, patches: torch.Tensor, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        key = tuple((t, h, w) for t, h, w in grids)
        if key in self._eager:
            return self.tower.forward(patches, grids)
        entry = self._graphs.get(key)
        if entry is None:
            try:
                entry = self._capture(patches, grids)
            except RuntimeError as e:  # (a capture that fails leaves these sizes eager)
                logger.warning("the vision tower runs eagerly for images %s: %s", list(grids), e)
                self._eager.add(key)
                return self.tower.forward(patches, grids)
            self._graphs[key] = entry
            while len(self._graphs) > self.limit:
                self._graphs.popitem(last=False)
        self._graphs.move_to_end(key)
        static, graph, out, _ = entry
        static.copy_(patches)
        graph.replay()
        return out.clone()  # (the next replay writes over out)

    @torch.inference_mode()
    def _capture(
        self, patches: torch.Tensor, grids: list[tuple[int, int, int]]
    ) -> tuple[torch.Tensor, torch.cuda.CUDAGraph, torch.Tensor, VisionPlan]:
        plan = self.tower.plan(grids)
        static = patches.clone()
        self.tower.run(static, plan)  # its kernels compile outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            out = self.tower.run(static, plan)
        self._pool = graph.pool()
        logger.info("captured the vision tower's CUDA graph for images %s", list(grids))
        return static, graph, out, plan
