"""Reference attention over the paged KV cache in plain torch: the CPU path. Its per-request
maths (write, gather, attend) lives in mmserve.kernels.paged_ref, the Triton kernels' oracle."""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate

import torch
import torch.nn.functional as F

from mmserve.attention.backend import AttentionBackend, AttentionMetadata
from mmserve.kernels import cpu_attention, cpu_layers
from mmserve.kernels.paged_ref import FP8, context_mask, gather_context, write_kv_cache


def length_groups(lengths: list[int]) -> list[list[int]]:
    """Request indices, longest first, cut into groups whose lengths are all more than half
    the group's longest: padding a group to its longest at most doubles its work."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    groups: list[list[int]] = []
    for i in order:
        if not groups or 2 * lengths[i] <= lengths[groups[-1][0]]:
            groups.append([])
        groups[-1].append(i)
    return groups


def attend_own_tokens(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None,
) -> torch.Tensor:
    """An encoder step: each request attends within its own new tokens (attend_within)."""
    out = torch.empty_like(q)
    lengths = meta.query_lens_cpu
    attend_within(q, k, v, lengths, list(range(len(lengths))), scale, meta.causal, sliding_window, out)
    return out


def attend_within(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    lengths: list[int],
    requests: list[int],
    scale: float,
    causal: bool,
    sliding_window: int | None,
    out: torch.Tensor,
) -> None:
    """Writes out's rows of `requests` (indices into the step's query lengths), each attending
    within its own new tokens: an encoder's, or a prompt with nothing cached before it.
    Requests of similar length run as one padded batch through scaled_dot_product_attention
    (padded keys masked out, padded queries dropped): the same maths as attend(), without a
    loop per request."""
    if not requests:
        return
    if len(requests) == len(lengths) and min(lengths) == max(lengths):
        # the flat batch is [R, L] already: views, no copies
        valid = torch.ones(len(lengths), lengths[0], dtype=torch.bool, device=q.device)
        q_pad, k_pad, v_pad = (x.unflatten(0, valid.shape) for x in (q, k, v))
        attended = _padded_sdpa(q_pad, k_pad, v_pad, valid, scale, causal, sliding_window)
        out.copy_(attended.reshape(q.shape))
        return
    starts = list(accumulate(lengths, initial=0))
    for group in length_groups([lengths[i] for i in requests]):
        members = [requests[g] for g in group]
        pos = torch.arange(lengths[members[0]], device=q.device)
        group_lens = torch.tensor([lengths[i] for i in members], device=q.device)
        group_starts = torch.tensor([starts[i] for i in members], device=q.device)
        valid = pos < group_lens[:, None]  # [G, L]: which padded slots are real tokens
        rows = torch.where(valid, group_starts[:, None] + pos, 0).flatten()  # [G * L] token rows
        q_pad, k_pad, v_pad = (_rows(x, rows).unflatten(0, valid.shape) for x in (q, k, v))
        attended = _padded_sdpa(q_pad, k_pad, v_pad, valid, scale, causal, sliding_window)
        keep = valid.flatten()
        attended = attended.reshape(len(rows), -1).to(q.dtype)  # [G * L, H * D]
        out.flatten(1).index_copy_(0, rows[keep], attended[keep])


def _rows(x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """x[rows] for x: [T, heads, D] (a strided view is fine); index_select on the flattened
    rows is several times faster than advanced indexing on CPU."""
    return x.flatten(1).index_select(0, rows).unflatten(1, x.shape[1:])


def _padded_sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    valid: torch.Tensor,
    scale: float,
    causal: bool,
    sliding_window: int | None,
) -> torch.Tensor:
    """q: [G, L, H, D]; k, v: [G, L, Hkv, D]; valid: [G, L]. Returns [G, L, H, D] in float32
    (as attend() computes); rows of padded queries are garbage, for the caller to drop."""
    group = q.shape[2] // k.shape[2]
    q, k, v = (x.transpose(1, 2).float() for x in (q, k, v))  # [G, heads, L, D]
    if sliding_window is None and bool(valid.all()):  # no mask to build, K and V not repeated
        out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale, enable_gqa=group > 1)
        return out.transpose(1, 2)  # (prompts of 16 x 128 tokens, 9 heads on 3: 9.4 -> 7.5 ms)
    if group > 1:
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    length = q.shape[2]
    pos = torch.arange(length, device=q.device)
    allowed = valid[:, None, None, :]  # [G, 1, 1, L]: keys that are real tokens
    if causal:
        allowed = allowed & (pos[None, :] <= pos[:, None])
    if sliding_window is not None:
        allowed = allowed & (pos[None, :] > pos[:, None] - sliding_window)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scale)
    return out.transpose(1, 2)


def attend_context(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    causal: bool,
    sliding_window: int | None,
) -> torch.Tensor:
    """attend() through one scaled_dot_product_attention: q [Q, H, D] at the last Q of S
    positions, k and v [S, Hkv, D]; returns [Q, H, D]. A chunk of a prompt after its cached
    (or earlier) positions. The heads that share a KV head ride along as extra query rows
    ([Hkv, G * Q, D] against [Hkv, S, D]): K and V are not repeated. A 64-token chunk over
    2,048 positions, 9 heads on 3, 2 threads: 2.3 ms against attend()'s einsums' 5-6."""
    num_q, num_heads, head_dim = q.shape
    seq_len, num_kv_heads, _ = k.shape
    group = num_heads // num_kv_heads
    rows = q.float().view(num_q, num_kv_heads, group, head_dim).permute(1, 2, 0, 3)
    rows = rows.reshape(num_kv_heads, group * num_q, head_dim)  # row g * Q + i: head kv * G + g
    mask = context_mask(num_q, seq_len, causal, sliding_window, q.device)
    if mask is not None:
        mask = mask.repeat(group, 1)
    # 4-D inputs: with 3-D ones the CPU takes SDPA's unfused math path (2.9 ms against 1.1 for
    # 64 queries over 1,024 positions)
    keys, values = (x.float().transpose(0, 1).unsqueeze(0) for x in (k, v))
    out = F.scaled_dot_product_attention(rows.unsqueeze(0), keys, values, attn_mask=mask, scale=scale)
    out = out.view(num_kv_heads, group, num_q, head_dim).permute(2, 0, 1, 3)
    return out.reshape(num_q, num_heads, head_dim).to(q.dtype)


class TorchAttentionBackend(AttentionBackend):
    """Decoder steps: the requests that decode one token attend together, through one
    scaled_dot_product_attention over their contexts gathered with one index_select per layer
    (decode_attention); prompts with nothing cached before them attend within their own new
    tokens, batched as an encoder's are (attend_within; with a float cache, whose values are
    the new K and V themselves); the others (chunks after a cached prefix, or any prompt with
    an FP8 cache) loop over requests through attend_context(). Encoder steps batch requests
    of similar length through one padded attention each."""

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor | None,
        meta: AttentionMetadata,
        scale: float,
        sliding_window: int | None = None,
        kv_scales: tuple[float, float] = (1.0, 1.0),
    ) -> torch.Tensor:
        if kv_cache is None:  # encoder: each request's own tokens are its whole context
            return attend_own_tokens(q, k, v, meta, scale, sliding_window)
        if cpu_layers.supports(k, v, kv_cache) and kv_cache.is_contiguous():
            cpu_layers.write_kv_cpu(k, v, kv_cache, meta.slot_mapping)
        else:
            write_kv_cache(k, v, kv_cache, meta.slot_mapping, kv_scales)
        plan = decode_plan(meta, kv_cache.shape[2])
        if len(plan.rows) == q.shape[0]:  # decodes only: the rows are the requests, in order
            return decode_attention(q, kv_cache, plan, scale, sliding_window, kv_scales)
        out = torch.empty_like(q)
        if len(plan.rows):
            attended = decode_attention(q[plan.rows], kv_cache, plan, scale, sliding_window, kv_scales)
            out.index_copy_(0, plan.rows, attended)
        lengths, fresh = meta.query_lens_cpu, []
        starts = list(accumulate(lengths, initial=0))
        for i, (q_len, seq_len) in enumerate(zip(lengths, meta.seq_lens_cpu)):
            if q_len == 0 or (q_len == 1 and meta.causal):
                continue  # a decode row, attended above (or a padding one, with no query)
            if q_len == seq_len and kv_cache.dtype != FP8:
                fresh.append(i)
                continue
            rows = slice(starts[i], starts[i] + q_len)
            ctx_k, ctx_v = gather_context(kv_cache, meta.block_tables[i], seq_len, kv_scales)
            out[rows] = attend_context(q[rows], ctx_k, ctx_v, scale, meta.causal, sliding_window)
        attend_within(q, k, v, lengths, fresh, scale, meta.causal, sliding_window, out)
        return out


@dataclass(frozen=True)
class DecodePlan:
    """Where the decoding requests of a step (one new token each) read their contexts, the
    same in every layer: derived once per step from the metadata."""

    rows: torch.Tensor  # [R] int64, the batch row of each decoding request's token
    slots: torch.Tensor  # [R * S] int64, the cache slot of each request's first S positions
    seq_lens: torch.Tensor  # [R, 1] int64, their context lengths (the query sits at seq_len - 1)
    width: int  # S: the longest of their contexts (shorter ones read slot padding, masked)
    tables: torch.Tensor  # [R, max_blocks] int32, their block tables (the C library reads them)


def decode_plan(meta: AttentionMetadata, block_size: int) -> DecodePlan:
    """The step's DecodePlan, computed by the first layer and kept in meta.derived."""
    cached = meta.derived.get("torch_decode")
    if cached is not None:
        rows, slots, seq_lens, tables = cached
        return DecodePlan(rows, slots, seq_lens, slots.numel() // max(1, len(rows)), tables)
    picked = [
        i for i, n in enumerate(meta.query_lens_cpu) if n == 1 and meta.causal
    ]  # (a non-causal step never decodes)
    starts = meta.query_start_loc.long()
    index = torch.tensor(picked, dtype=torch.int64, device=starts.device)
    rows = starts[index]
    width = max((meta.seq_lens_cpu[i] for i in picked), default=0)
    pos = torch.arange(width, device=starts.device)
    tables = meta.block_tables[index]  # [R, max_blocks]
    slots = tables[:, pos // block_size].long() * block_size + pos % block_size  # [R, S]
    seq_lens = meta.seq_lens[index].long().unsqueeze(1)
    slots = torch.where(pos < seq_lens, slots, 0).flatten()  # padding reads slot 0, masked
    tables = tables.to(torch.int32).contiguous()
    meta.derived["torch_decode"] = (rows, slots, seq_lens, tables)
    return DecodePlan(rows, slots, seq_lens, width, tables)


def decode_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    plan: DecodePlan,
    scale: float,
    sliding_window: int | None,
    kv_scales: tuple[float, float] = (1.0, 1.0),
) -> torch.Tensor:
    """q: [R, H, D], one query per decoding request at position seq_len - 1. Returns [R, H, D]:
    attend() for each request, all R in one padded attention. Grouped-query heads ride along
    as extra query rows ([R, Hkv, H / Hkv, D] against [R, Hkv, S, D]): K and V are never
    repeated. A float32 cache on a CPU whose C library built is read in place instead
    (mmserve.kernels.cpu_attention): no gathered copy."""
    if cpu_attention.supports(q, kv_cache):
        return cpu_attention.paged_decode_cpu(
            q, kv_cache, plan.tables, plan.seq_lens.view(-1), scale, sliding_window
        )
    num_reqs, num_heads, head_dim = q.shape
    num_kv_heads = kv_cache.shape[3]
    k, v = (
        _gather(kv_cache, 0, plan.slots, kv_scales[0]),
        _gather(kv_cache, 1, plan.slots, kv_scales[1]),
    )
    k, v = (x.view(num_reqs, plan.width, num_kv_heads, head_dim).transpose(1, 2) for x in (k, v))
    pos = torch.arange(plan.width, device=q.device)
    allowed = pos < plan.seq_lens  # [R, S]
    if sliding_window is not None:
        allowed = allowed & (pos > plan.seq_lens - 1 - sliding_window)
    grouped = q.float().view(num_reqs, num_kv_heads, num_heads // num_kv_heads, head_dim)
    out = F.scaled_dot_product_attention(
        grouped, k.float(), v.float(), attn_mask=allowed[:, None, None, :], scale=scale
    )
    return out.reshape(num_reqs, num_heads, head_dim).to(q.dtype)


def _gather(kv_cache: torch.Tensor, which: int, slots: torch.Tensor, scale: float) -> torch.Tensor:
    """K (0) or V (1) at the slots: [len(slots), Hkv * D], read back from FP8 with its scale."""
    flat = kv_cache[which].flatten(0, 1).flatten(1)  # [num_blocks * block_size, Hkv * D]
    if kv_cache.dtype == FP8:  # (the CPU has no index_select of float8: gather the bytes)
        return flat.view(torch.uint8).index_select(0, slots).view(FP8).float() * scale
    return flat.index_select(0, slots)
