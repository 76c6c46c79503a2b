"""The numpy batch builder gives exactly the FlatBatch of a plain list-based builder (the
runner's original build_batch, kept here as the oracle) on random plans: chunked prefills mixed
with decodes, images, multimodal rotary positions, segment ids, and encoders without KV cache."""

from __future__ import annotations

import random

import pytest
import torch

from mmserve.attention import AttentionMetadata
from mmserve.engine.sched_output import ScheduledRequest, SchedulerOutput
from mmserve.inputs import MMInput, MMPlaceholder
from mmserve.params import SamplingParams
from mmserve.runner.input_batch import FlatBatch, InputBatchBuilder, build_batch

BLOCK_SIZE = 4


def reference_build_batch(
    plan: SchedulerOutput,
    block_size: int,
    device: torch.device,
    causal: bool = True,
    mrope: bool = False,
    image_rows: bool = True,
) -> FlatBatch:
    """One Python list per field, one tensor per request's block table."""
    input_ids: list[int] = []
    type_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    query_lens, seq_lens, sample_rows, sample_reqs = [], [], [], []
    rows: list[tuple[int, MMInput, int, int]] = []
    mrope_chunks: list[torch.Tensor] = []
    for item in plan.scheduled:
        n, start = len(item.token_ids), item.start_pos
        for mm in item.mm_inputs if image_rows else ():
            first, end = max(start, mm.start), min(start + n, mm.end)
            rows.append((len(input_ids) + first - start, mm, first - mm.start, end - mm.start))
        input_ids += item.token_ids
        type_ids += item.token_type_ids or [0] * n
        pos = range(start, start + n)
        positions += (
            pos if not mrope else range(start + item.mrope_delta, start + n + item.mrope_delta)
        )
        if mrope:
            mrope_chunks.append(_reference_mrope_chunk(item, start, n))
        if item.block_ids:
            slots += [item.block_ids[p // block_size] * block_size + p % block_size for p in pos]
        else:
            slots += [-1] * n
        query_lens.append(n)
        seq_lens.append(start + n)
        if item.sample:
            sample_rows.append(len(input_ids) - 1)
            sample_reqs.append(item)
    max_blocks = max(len(s.block_ids) for s in plan.scheduled)
    tables = torch.zeros(len(plan.scheduled), max_blocks, dtype=torch.int32)
    for i, item in enumerate(plan.scheduled):
        tables[i, : len(item.block_ids)] = torch.tensor(item.block_ids, dtype=torch.int32)
    qsl = torch.zeros(len(query_lens) + 1, dtype=torch.int32)
    qsl[1:] = torch.tensor(query_lens).cumsum(0)

    def dev(x: list[int] | torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return torch.as_tensor(x, dtype=dtype).to(device)

    meta = AttentionMetadata(
        query_start_loc=dev(qsl, torch.int32),
        seq_lens=dev(seq_lens, torch.int32),
        block_tables=dev(tables, torch.int32),
        slot_mapping=dev(slots, torch.int64),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        query_lens_cpu=query_lens,
        seq_lens_cpu=seq_lens,
        causal=causal,
    )
    has_types = any(s.token_type_ids for s in plan.scheduled)
    in_prompt = any(
        s.mrope_positions is not None and s.start_pos < len(s.prompt_token_ids)
        for s in plan.scheduled
    )
    return FlatBatch(
        dev(input_ids, torch.int64),
        dev(torch.cat(mrope_chunks, dim=1) if in_prompt else positions, torch.int64),
        meta,
        sample_rows,
        sample_reqs,
        dev(type_ids, torch.int64) if has_types else None,
        rows,
    )


def _reference_mrope_chunk(item: ScheduledRequest, start: int, n: int) -> torch.Tensor:
    table = item.mrope_positions
    prompt = 0 if table is None else table.shape[1]
    first_generated = max(start, prompt)
    tail = torch.arange(first_generated, max(start + n, first_generated)) + item.mrope_delta
    if start >= prompt:
        return tail.expand(3, -1)
    return torch.cat([table[:, start : min(start + n, prompt)], tail.expand(3, -1)], dim=1)


def _images(rng: random.Random, prompt_len: int) -> tuple[MMInput, ...]:
    out, pos = [], rng.randrange(0, 4)
    while pos < prompt_len - 2 and rng.random() < 0.7:
        length = rng.randint(1, min(9, prompt_len - pos))
        out.append(MMInput(MMPlaceholder(f"img{pos}", pos, length), {}))
        pos += length + rng.randrange(0, 5)
    return tuple(out)


def _request(rng: random.Random, i: int, kv: bool, types: bool, mrope: bool) -> ScheduledRequest:
    prompt_len = rng.randint(1, 40)
    num_out = rng.choice([0, 0, rng.randint(1, 20)])
    total = prompt_len + num_out
    if num_out and rng.random() < 0.6:  # a decode
        start, n = total - 1, 1
    else:  # a prompt chunk, or a recompute after preemption
        start = rng.randrange(0, total)
        n = rng.randint(1, total - start)
    needed = -(-(start + n) // BLOCK_SIZE)
    block_ids = rng.sample(range(1000), needed + rng.choice([0, 0, 1])) if kv else []
    images = _images(rng, prompt_len)
    prompt = [rng.randrange(100) for _ in range(prompt_len)]
    output = [rng.randrange(100) for _ in range(num_out)]
    delta = rng.randint(-30, 5)
    has_table = mrope and images and rng.random() < 0.8
    return ScheduledRequest(
        request_id=f"r{i}",
        token_ids=(prompt + output)[start : start + n],
        start_pos=start,
        block_ids=block_ids,
        sample=start + n == total,
        params=SamplingParams(temperature=0.0),
        prompt_token_ids=prompt,
        output_token_ids=output,
        eos_token_ids=frozenset(),
        token_type_ids=[rng.randrange(2) for _ in range(n)]
        if types and rng.random() < 0.5
        else None,
        mm_inputs=tuple(mm for mm in images if mm.overlaps(start, start + n)),
        mrope_positions=torch.randint(0, 50, (3, prompt_len)) if has_table else None,
        mrope_delta=delta if mrope else 0,
    )


def _plan(rng: random.Random, kv: bool, types: bool, mrope: bool) -> SchedulerOutput:
    n = rng.choice([1, 2, rng.randint(1, 12)])
    return SchedulerOutput(scheduled=[_request(rng, i, kv, types, mrope) for i in range(n)])


def assert_same_batch(new: object, old: FlatBatch) -> None:
    for name in ("input_ids", "positions", "token_type_ids"):
        a, b = getattr(new, name), getattr(old, name)
        assert (a is None) == (b is None), name
        if a is not None:
            assert a.dtype == b.dtype and a.device == b.device and torch.equal(a.cpu(), b.cpu()), (
                name
            )
    for name in ("query_start_loc", "seq_lens", "block_tables", "slot_mapping"):
        a, b = getattr(new.meta, name), getattr(old.meta, name)  # type: ignore[attr-defined]
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.cpu(), b.cpu()), name
    for name in ("max_query_len", "max_seq_len", "query_lens_cpu", "seq_lens_cpu", "causal"):
        a, b = getattr(new.meta, name), getattr(old.meta, name)  # type: ignore[attr-defined]
        assert a == b and type(a) is type(b), name
        if isinstance(a, list):
            assert all(type(x) is int for x in a), name
    assert new.sample_rows == old.sample_rows  # type: ignore[attr-defined]
    assert all(a is b for a, b in zip(new.sample_reqs, old.sample_reqs, strict=True))  # type: ignore[attr-defined]
    assert len(new.image_rows) == len(old.image_rows)  # type: ignore[attr-defined]
    for a, b in zip(new.image_rows, old.image_rows):  # type: ignore[attr-defined]
        assert a[0] == b[0] and a[1] is b[1] and a[2:] == b[2:]


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize(
    ("kv", "types", "mrope", "causal", "image_rows"),
    [
        (True, False, False, True, True),  # a decoder
        (True, False, True, True, True),  # Qwen2-VL
        (True, False, False, True, False),
        (False, True, False, False, True),  # a BERT-style encoder, no KV cache
        (False, False, False, False, False),  # a dual encoder
    ],
)
def test_same_as_reference(
    seed: int, kv: bool, types: bool, mrope: bool, causal: bool, image_rows: bool
) -> None:
    rng = random.Random(seed)
    builder = InputBatchBuilder(BLOCK_SIZE, torch.device("cpu"), causal, mrope, image_rows)
    for _ in range(40):
        plan = _plan(rng, kv, types, mrope)
        args = (plan, BLOCK_SIZE, torch.device("cpu"), causal, mrope, image_rows)
        old = reference_build_batch(*args)
        assert_same_batch(builder.build(plan), old)
        assert_same_batch(build_batch(*args), old)


def test_steady_decode_and_mixed_kv_rows() -> None:
    """Every row as wide as the table (the fast fill), and a batch mixing rows with and
    without KV blocks (slot -1 for the latter)."""
    rng = random.Random(7)
    plan = _plan(rng, True, False, False)
    for item in plan.scheduled:
        item.block_ids = list(range(8))
        item.start_pos, item.token_ids = 20 + rng.randrange(12), [5]
    assert_same_batch(
        build_batch(plan, BLOCK_SIZE, torch.device("cpu")),
        reference_build_batch(plan, BLOCK_SIZE, torch.device("cpu")),
    )
    plan.scheduled[0].block_ids = []
    assert_same_batch(
        build_batch(plan, BLOCK_SIZE, torch.device("cpu")),
        reference_build_batch(plan, BLOCK_SIZE, torch.device("cpu")),
    )


def test_too_few_blocks_raises() -> None:
    rng = random.Random(3)
    plan = _plan(rng, True, False, False)
    item = plan.scheduled[0]
    item.block_ids = item.block_ids[: (item.start_pos + len(item.token_ids) - 1) // BLOCK_SIZE]
    if not item.block_ids:
        item.block_ids = [1]
        item.start_pos = BLOCK_SIZE
    with pytest.raises(IndexError):
        build_batch(plan, BLOCK_SIZE, torch.device("cpu"))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned buffers need CUDA")
def test_reused_pinned_buffers_on_cuda() -> None:
    """Buffers reused step after step (growing and shrinking) never leak an old step's data."""
    rng = random.Random(11)
    device = torch.device("cuda")
    builder = InputBatchBuilder(BLOCK_SIZE, device, True, True, True)
    batches = []
    for _ in range(60):
        plan = _plan(rng, True, False, True)
        batches.append(
            (builder.build(plan), reference_build_batch(plan, BLOCK_SIZE, device, True, True))
        )
    for new, old in batches:  # checked after all steps: no batch aliases a later one
        assert_same_batch(new, old)


def test_block_tables_kept_across_steps() -> None:
    """One builder over a run of steps, as a runner uses it: requests decode and grow a block
    every few steps (num_kept_blocks = the blocks of their previous step), are preempted and
    come back with other blocks (num_kept_blocks 0), finish, and new ones take their rows."""
    rng = random.Random(5)
    builder = InputBatchBuilder(BLOCK_SIZE, torch.device("cpu"))
    free_blocks = list(range(5000))
    rng.shuffle(free_blocks)
    live: dict[str, tuple[int, list[int]]] = {}  # request id -> (tokens computed, block ids)
    next_id, finished = 0, []
    for _ in range(300):
        while len(live) < rng.randint(1, 20):
            live[f"r{next_id}"] = (rng.randint(0, 40), [])
            next_id += 1
        scheduled = []
        for rid in list(live):
            start, blocks = live[rid]
            if rng.random() < 0.05:  # finished
                del live[rid]
                finished.append(rid)
                continue
            if rng.random() < 0.05:  # preempted: recomputed later with new blocks
                start, blocks = rng.randint(0, 10), []
            if rng.random() < 0.2:  # not scheduled this step: its rows stay as they are
                live[rid] = (start, blocks)
                continue
            n = rng.choice([1, 1, 1, rng.randint(1, 9)])
            kept = len(blocks)
            blocks = blocks + [
                free_blocks.pop() for _ in range(-(-(start + n) // BLOCK_SIZE) - kept)
            ]
            item = _request(rng, 0, True, False, False)
            item.request_id, item.start_pos, item.token_ids = rid, start, [7] * n
            item.block_ids, item.num_kept_blocks = list(blocks), kept
            item.mm_inputs, item.mrope_positions = (), None
            scheduled.append(item)
            live[rid] = (start + n, blocks)
        if not scheduled:
            continue
        plan = SchedulerOutput(scheduled=scheduled, finished_ids=finished)
        finished = []
        assert_same_batch(
            builder.build(plan), reference_build_batch(plan, BLOCK_SIZE, torch.device("cpu"))
        )
