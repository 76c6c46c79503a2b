"""Builds the flat batch of one step from the scheduler's plan: one Python pass over the
requests, numpy for every per-token array, a block table kept across steps (a decode step
writes only the blocks a request gained), host buffers that on CUDA are pinned and reused,
and one non-blocking copy per tensor to the device."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from mmserve.attention import AttentionMetadata
from mmserve.engine.sched_output import ScheduledRequest, SchedulerOutput
from mmserve.inputs import MMInput
from mmserve.request import PLACEHOLDER


@dataclass
class FlatBatch:
    """All new tokens of all scheduled requests, back to back."""

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64, or [3, T] under multimodal rotary while a prompt runs
    meta: AttentionMetadata
    sample_rows: list[int]  # row of the last token of each request that samples
    sample_reqs: list[ScheduledRequest]  # the requests of sample_rows, same order
    token_type_ids: torch.Tensor | None  # [T] int64 when some request has segment ids
    image_rows: list[tuple[int, MMInput, int, int]]  # (batch row, image, first, end row in it)


@dataclass
class SampledOnDevice:
    """The tokens one step sampled, before they reach the host: [N] int64 on the device, and
    the row of each request that sampled."""

    tokens: torch.Tensor
    rows: dict[str, int]


class _HostBuffers:
    """Host arrays for one step. With `reuse` (CUDA) they are pinned and kept across steps,
    and a buffer is rewritten only after the copies that read it last step have completed;
    otherwise each step gets fresh arrays (on the CPU the batch tensors are these arrays)."""

    def __init__(self, reuse: bool) -> None:
        self.reuse = reuse
        self._buffers: dict[str, tuple[torch.Tensor, np.ndarray]] = {}  # pinned tensor, its view
        self._copied = torch.cuda.Event() if reuse else None  # recorded after a step's copies
        self._pending = False  # _copied is recorded and not yet waited for

    def begin(self) -> None:
        if self._pending and self._copied is not None:
            self._copied.synchronize()  # normally long done: the step synchronised on its tokens
        self._pending = False

    def end(self) -> None:
        if self._copied is not None:
            self._copied.record()
            self._pending = True

    def take(self, name: str, n: int, dtype: type[np.signedinteger]) -> np.ndarray:
        """A 1-D array of n elements, contents undefined."""
        if not self.reuse:
            return np.empty(n, dtype)
        entry = self._buffers.get(name)
        if entry is None or len(entry[1]) < n:
            size = max(n, 2 * (0 if entry is None else len(entry[1])), 256)
            pinned = torch.empty(size, dtype=_TORCH_DTYPES[dtype], pin_memory=True)
            entry = self._buffers[name] = (pinned, pinned.numpy())
        return entry[1][:n]

    def fill(self, name: str, values: list[int], dtype: type[np.signedinteger]) -> np.ndarray:
        """A 1-D array holding values."""
        array = np.fromiter(values, dtype, len(values))
        if not self.reuse:
            return array
        out = self.take(name, len(values), dtype)
        out[:] = array
        return out


_TORCH_DTYPES = {np.int32: torch.int32, np.int64: torch.int64}


class _BlockTables:
    """Host block table of every request seen and not finished, one row each, kept across
    steps: a step writes only the ids a request gained since its previous step (the plan's
    num_kept_blocks says how many leading ids are unchanged). Cells past a row's length are 0."""

    def __init__(self) -> None:
        self._rows: dict[str, int] = {}  # request id -> row
        self._lens: list[int] = []  # ids held by each row
        self._free: list[int] = []  # rows of finished requests
        self._table = np.zeros((0, 0), np.int32)

    def drop(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            row = self._rows.pop(request_id, None)
            if row is not None:
                self._table[row, : self._lens[row]] = 0
                self._lens[row] = 0
                self._free.append(row)

    def rows(self, scheduled: list[ScheduledRequest]) -> list[int]:
        """Brings the rows of the scheduled requests up to date; returns them in batch order."""
        out = []
        for item in scheduled:
            row = self._rows.get(item.request_id)
            if row is None:
                row = self._rows[item.request_id] = self._new_row()
            ids, held = item.block_ids, self._lens[row]
            if len(ids) != held or item.num_kept_blocks < held:
                self._write(row, ids, min(item.num_kept_blocks, held))
            out.append(row)
        return out

    def gather(self, rows: list[int], width: int, out: np.ndarray) -> None:
        """out [len(rows), width] = the rows' first width cells."""
        out[:] = self._table[rows, :width]

    def _write(self, row: int, ids: list[int], kept: int) -> None:
        if len(ids) > self._table.shape[1]:
            wider = np.zeros((len(self._table), max(len(ids), 2 * self._table.shape[1])), np.int32)
            wider[:, : self._table.shape[1]] = self._table
            self._table = wider
        self._table[row, kept : len(ids)] = ids[kept:]
        self._table[row, len(ids) : self._lens[row]] = 0
        self._lens[row] = len(ids)

    def _new_row(self) -> int:
        if not self._free:
            grown = len(self._table)
            taller = np.zeros((max(2 * grown, 16), self._table.shape[1]), np.int32)
            taller[:grown] = self._table
            self._table = taller
            self._lens += [0] * (len(taller) - grown)
            self._free = list(range(len(taller) - 1, grown - 1, -1))
        return self._free.pop()


class InputBatchBuilder:
    """Turns plans into FlatBatches for one runner (its block size, device and model kind).

    causal: False for encoders. mrope: the model takes multimodal rotary positions. image_rows:
    False when the model embeds image inputs itself (dual encoders). reuse_buffers: keep pinned
    host buffers across steps (CUDA only; a builder used for one batch need not pin).
    """

    def __init__(
        self,
        block_size: int,
        device: torch.device,
        causal: bool = True,
        mrope: bool = False,
        image_rows: bool = True,
        reuse_buffers: bool = True,
    ) -> None:
        self.block_size = block_size
        self.device = device
        self.causal = causal
        self.mrope = mrope
        self.image_rows = image_rows
        self._on_cpu = device.type == "cpu"  # the host arrays are the batch tensors
        self._host = _HostBuffers(reuse_buffers and device.type == "cuda")
        self._tables = _BlockTables()

    def forget(self, request_ids: list[str]) -> None:
        """Drops the state of ended requests. Every plan's finished_ids should reach it: build
        does that, so call it only for a plan not built (an empty one). A request left behind
        costs a table row, never a wrong batch (its next first step rewrites its row)."""
        self._tables.drop(request_ids)

    def build(self, plan: SchedulerOutput, previous: SampledOnDevice | None = None) -> FlatBatch:
        """previous: the tokens the step before sampled, still on the device; each request's
        PLACEHOLDER (its last token, with async scheduling) is taken from there."""
        self.forget(plan.finished_ids)
        self._host.begin()
        try:
            return self._build(plan, previous)
        finally:
            self._host.end()

    def _build(self, plan: SchedulerOutput, previous: SampledOnDevice | None) -> FlatBatch:
        scheduled = plan.scheduled
        token_ids: list[int] = []
        query_lens: list[int] = []
        starts: list[int] = []
        num_blocks: list[int] = []
        sample_rows: list[int] = []
        sample_reqs: list[ScheduledRequest] = []
        rows: list[tuple[int, MMInput, int, int]] = []
        filled: list[int] = []  # rows holding a placeholder
        sources: list[int] = []  # their rows in previous.tokens
        for item in scheduled:  # the only per-request Python loop
            row = len(token_ids)
            token_ids += item.token_ids
            n = len(token_ids) - row
            if token_ids[-1] == PLACEHOLDER:
                if previous is None or item.request_id not in previous.rows:
                    raise RuntimeError(f"request {item.request_id}: a pending token without its step")
                filled.append(row + n - 1)
                sources.append(previous.rows[item.request_id])
            query_lens.append(n)
            starts.append(item.start_pos)
            num_blocks.append(len(item.block_ids))
            if item.sample:
                sample_rows.append(row + n - 1)
                sample_reqs.append(item)
            if item.mm_inputs and self.image_rows:
                rows += _image_rows(item, row, n)

        host = self._host
        num_reqs, num_tokens = len(scheduled), len(token_ids)
        ends, req_of_token, positions, seq_lens = _layout(starts, query_lens, num_tokens)
        tables = self._block_tables(scheduled, num_blocks)
        slots = host.take("slot_mapping", num_tokens, np.int64)
        _slot_mapping(tables, num_blocks, req_of_token, positions, self.block_size, slots)
        qsl = host.take("query_start_loc", num_reqs + 1, np.int32)
        qsl[0] = 0
        qsl[1:] = ends
        seq_lens_np = host.take("seq_lens", num_reqs, np.int32)
        seq_lens_np[:] = seq_lens

        seq_lens_cpu = seq_lens.tolist()
        meta = AttentionMetadata(
            query_start_loc=self._to_device(qsl),
            seq_lens=self._to_device(seq_lens_np),
            block_tables=self._to_device(tables),
            slot_mapping=self._to_device(slots),
            max_query_len=max(query_lens),
            max_seq_len=max(seq_lens_cpu),
            query_lens_cpu=query_lens,
            seq_lens_cpu=seq_lens_cpu,
            causal=self.causal,
        )
        input_ids = self._to_device(host.fill("input_ids", token_ids, np.int64))
        if filled:
            assert previous is not None
            self._fill_placeholders(input_ids, filled, sources, previous.tokens)
        return FlatBatch(
            input_ids,
            self._positions(scheduled, positions, req_of_token),
            meta,
            sample_rows,
            sample_reqs,
            self._token_type_ids(scheduled),
            rows,
        )

    def _fill_placeholders(
        self, input_ids: torch.Tensor, rows: list[int], sources: list[int], tokens: torch.Tensor
    ) -> None:
        """input_ids[rows] = tokens[sources], on the device (no wait for the step before)."""
        if len(rows) == len(input_ids) == len(tokens) and sources == rows:
            input_ids.copy_(tokens)  # a decode batch in the same order as the step before
            return
        index = self._to_device(self._host.fill("filled_rows", rows + sources, np.int64))
        input_ids[index[: len(rows)]] = tokens[index[len(rows) :]]

    def _block_tables(self, scheduled: list[ScheduledRequest], num_blocks: list[int]) -> np.ndarray:
        """[num_reqs, max_blocks] int32, each request's blocks padded with 0."""
        rows = self._tables.rows(scheduled)
        width = max(num_blocks)
        tables = self._host.take("block_tables", len(rows) * width, np.int32)
        tables = tables.reshape(len(rows), width)
        self._tables.gather(rows, width, tables)
        return tables

    def _positions(
        self, scheduled: list[ScheduledRequest], positions: np.ndarray, req_of_token: np.ndarray
    ) -> torch.Tensor:
        """[T] int64 positions, or [3, T] while some request still runs its multimodal prompt."""
        in_prompt = any(
            s.mrope_positions is not None and s.start_pos < len(s.prompt_token_ids)
            for s in scheduled
        )
        if in_prompt:
            chunks = [mrope_chunk(s) for s in scheduled] if self.mrope else []
            return torch.cat(chunks, dim=1).to(self.device, torch.int64, non_blocking=True)
        out = self._host.take("positions", len(positions), np.int64)
        if self.mrope:  # generated tokens: index + delta in all three rows, given as 1-D
            deltas = np.array([s.mrope_delta for s in scheduled], dtype=np.int64)
            np.add(positions, deltas[req_of_token], out=out)
        else:
            out[:] = positions
        return self._to_device(out)

    def _token_type_ids(self, scheduled: list[ScheduledRequest]) -> torch.Tensor | None:
        if not any(s.token_type_ids for s in scheduled):
            return None
        type_ids: list[int] = []
        for s in scheduled:
            type_ids += s.token_type_ids or [0] * len(s.token_ids)
        return self._to_device(self._host.fill("token_type_ids", type_ids, np.int64))

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        tensor = torch.from_numpy(array)
        return tensor if self._on_cpu else tensor.to(self.device, non_blocking=True)


def _layout(
    starts: list[int], query_lens: list[int], num_tokens: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Where each request's tokens sit: the end row of each request [R], the request of each
    token [T], the position of each token [T], and each request's context length [R]."""
    start = np.array(starts, dtype=np.int64)
    if num_tokens == len(starts):  # decodes only: one token per request
        ends = np.arange(1, num_tokens + 1)
        return ends, ends - 1, start, start + 1
    lens = np.array(query_lens, dtype=np.int64)
    ends = lens.cumsum()
    req_of_token = np.repeat(np.arange(len(starts)), lens)
    positions = np.arange(num_tokens) + np.repeat(start - (ends - lens), lens)
    return ends, req_of_token, positions, start + lens


def _slot_mapping(
    tables: np.ndarray,
    num_blocks: list[int],
    req_of_token: np.ndarray,
    positions: np.ndarray,
    block_size: int,
    out: np.ndarray,
) -> None:
    """Fills out [T] with each token's cache slot; -1 for the tokens of a request that holds no
    KV blocks (an encoder's). tables: [num_reqs, max_blocks]; the arrays: [T]."""
    index = positions // block_size
    blocks_of_token = np.array(num_blocks)[req_of_token]
    # (np.count_nonzero: a C call, where ndarray.any() costs microseconds on tiny arrays)
    if np.count_nonzero(index >= blocks_of_token):  # true for every token of a request without KV
        if not tables.shape[1]:
            out.fill(-1)
            return
        has_kv = blocks_of_token > 0
        if np.count_nonzero(has_kv & (index >= blocks_of_token)):
            raise IndexError("a scheduled request has too few KV blocks for its tokens")
        out.fill(-1)
        rows, index, pos = req_of_token[has_kv], index[has_kv], positions[has_kv]
        out[has_kv] = tables[rows, index] * block_size + pos % block_size
        return
    np.add(tables[req_of_token, index] * block_size, positions % block_size, out=out)


def _image_rows(item: ScheduledRequest, row: int, n: int) -> list[tuple[int, MMInput, int, int]]:
    """The rows of each image inside this chunk: (batch row, image, first, end row in it)."""
    out = []
    start = item.start_pos
    for mm in item.mm_inputs:
        first, end = max(start, mm.start), min(start + n, mm.end)
        out.append((row + first - start, mm, first - mm.start, end - mm.start))
    return out


def mrope_chunk(item: ScheduledRequest) -> torch.Tensor:
    """[3, n] multimodal positions of one chunk: the prompt's precomputed rows, then
    index + delta in all three rows for generated tokens (1-D positions stand for that)."""
    start, n = item.start_pos, len(item.token_ids)
    table = item.mrope_positions
    prompt = 0 if table is None else table.shape[1]
    first_generated = max(start, prompt)
    tail = torch.arange(first_generated, max(start + n, first_generated)) + item.mrope_delta
    if start >= prompt:
        return tail.expand(3, -1)
    return torch.cat([table[:, start : min(start + n, prompt)], tail.expand(3, -1)], dim=1)


def build_batch(
    plan: SchedulerOutput,
    block_size: int,
    device: torch.device,
    causal: bool = True,
    mrope: bool = False,
    image_rows: bool = True,
) -> FlatBatch:
    """One batch from a fresh builder (no buffers kept); a runner keeps an InputBatchBuilder."""
    builder = InputBatchBuilder(block_size, device, causal, mrope, image_rows, reuse_buffers=False)
    return builder.build(plan)
